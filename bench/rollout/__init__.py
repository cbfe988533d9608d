"""The rollout benchmark: a bad canary, a progressive rollout against a blind split."""
