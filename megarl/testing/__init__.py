"""Test harness shipped with the package: simulated tensor parallelism (threads) and a real gloo
worker pool, used by megarl's own property tests and by tests of later method families."""
