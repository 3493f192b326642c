"""Training objectives beyond next-token prediction: what a run's loss is, what it needs besides the policy
(a reference model), and what it reports. `preference`: DPO and its family (train.objective=preference)."""
