"""Tools a policy calls during its rollout (the built-in calculator first)."""
