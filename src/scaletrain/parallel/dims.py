"""The layout of ranks: how many take part in each kind of parallelism, and the device mesh.

    world_size = pp × dp_replicate × dp_shard × tp

Mesh axes, outermost first: `pp`, `dp_replicate`, `dp_shard`, `tp`. Tensor parallelism is
innermost so its ranks are neighbours (the same node, the fastest links); pipeline stages are
outermost because they exchange the least. The data-parallel ranks (replicate × shard) are also
available as one flattened axis, `dp`, for the loader and for DDP.
"""

from __future__ import annotations

from dataclasses import dataclass

from scaletrain.config import ParallelConfig
from scaletrain.errors import ConfigError


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world_size: int

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> "ParallelDims":
        """Resolve `dp_shard = -1` and check that the layout uses exactly `world_size` ranks."""
        fixed = cfg.dp_replicate * cfg.tp * cfg.pp
        if cfg.dp_shard == 0:
            raise ConfigError("parallel.dp_shard=0 is not a size; use -1 for all remaining ranks or a positive number")
        if cfg.dp_shard == -1:
            if world_size % fixed:
                raise ConfigError(
                    f"the layout needs a multiple of dp_replicate × tp × pp = {cfg.dp_replicate} × {cfg.tp} × "
                    f"{cfg.pp} = {fixed} ranks, but the world has {world_size}; change the layout or the "
                    f"number of processes (--nproc)")
            dp_shard = world_size // fixed
        else:
            dp_shard = cfg.dp_shard
            if fixed * dp_shard != world_size:
                raise ConfigError(
                    f"the layout pp × dp_replicate × dp_shard × tp = {cfg.pp} × {cfg.dp_replicate} × {dp_shard} × "
                    f"{cfg.tp} = {fixed * dp_shard} ranks, but the world has {world_size}; set parallel.dp_shard=-1 "
                    f"to use the remaining ranks, or launch {fixed * dp_shard} processes")
        return cls(cfg.dp_replicate, dp_shard, cfg.tp, cfg.pp, world_size)

    @property
    def dp(self) -> int:
        """Data-parallel size: ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def names(self) -> tuple[str, ...]:
        return ("pp", "dp_replicate", "dp_shard", "tp")

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    def build_mesh(self, device_type: str):
        """The 4-D device mesh (every axis present, size 1 or more) and the flattened `dp` mesh."""
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=self.names)
        return mesh, mesh["dp_replicate", "dp_shard"]._flatten("dp")

    def describe(self) -> str:
        return (f"{self.world_size} rank(s) = pp {self.pp} × dp_replicate {self.dp_replicate} × "
                f"dp_shard {self.dp_shard} × tp {self.tp}")
