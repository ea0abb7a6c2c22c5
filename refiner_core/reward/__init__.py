"""Rewards: composition and its SQL, citations, verifiers, ground truth, pseudo-labels, rescoring."""
