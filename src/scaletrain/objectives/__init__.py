"""Training objectives beyond next-token prediction: what a run's loss is, what it needs besides the policy
(a reference model), and what it reports. `preference`: DPO and its family (train.objective=preference);
`rewards`: the verifiable rewards of RL (issue 50; its losses are scaletrain.model.rl)."""
