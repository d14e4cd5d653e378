"""Communication: every ``torch.distributed`` call, the per-step agreement checks' groups, peer
failures and the shared-memory exchange between two ranks of one host."""
