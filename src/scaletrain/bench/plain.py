"""The minimal hand-written PyTorch training loop, as a yardstick for scaletrain's own step.

What a user would write in an afternoon, nanoGPT-style: random windows of a token tensor,
forward under autocast, cross-entropy, backward, clip, AdamW, zero the gradients. Same model
class and initialization as scaletrain (`scaletrain.model.Transformer`), one process, one
micro-batch per step. `torch.compile` compiles the whole model, the one-line way.

It has no loss scaling and no master weights, so it runs the modes that need neither:
32-true, tf32 and bf16-mixed.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from scaletrain.errors import ConfigError
from scaletrain.model.transformer import Transformer
from scaletrain.parallel.init import init_weights

PLAIN_MODES = ("32-true", "tf32", "bf16-mixed")


class PlainLoop:
    def __init__(self, cfg, tokens: torch.Tensor, device: torch.device, micro_batch: int):
        """`cfg`: a JobConfig (model, optimizer, precision, seed); `tokens`: the 1-D token data."""
        mode = cfg.precision.mode
        if mode not in PLAIN_MODES:
            raise ConfigError(f"the hand-written loop runs precision.mode {', '.join(PLAIN_MODES)} (it has no loss "
                              f"scaling or master weights), not {mode}")
        self.cfg, self.tokens, self.device = cfg, tokens, device
        self.B, self.T = micro_batch, cfg.data.seq_len
        model = Transformer(cfg.model).to(device)
        init_weights(model, cfg.train.seed)
        self.params = list(model.parameters())
        self.model = torch.compile(model) if cfg.train.compile else model
        o = cfg.optim
        self.opt = torch.optim.AdamW(self.params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                     weight_decay=o.weight_decay, fused=True)
        self.clip = cfg.train.grad_clip or float("inf")
        self.matmul_precision = "high" if mode == "tf32" else "highest"
        self.autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if mode == "bf16-mixed" \
            else contextlib.nullcontext

    def enter(self) -> None:
        """The process-wide matmul setting this loop's precision mode needs."""
        torch.set_float32_matmul_precision(self.matmul_precision)

    def step(self) -> None:
        B, T, data = self.B, self.T, self.tokens
        ix = torch.randint(len(data) - T - 1, (B,))
        x = torch.stack([data[i:i + T] for i in ix]).long().to(self.device)
        y = torch.stack([data[i + 1:i + 1 + T] for i in ix]).long().to(self.device)
        with self.autocast():
            logits = self.model(x)  # (B, T, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
