"""The shared stage engine: StageRun (lifecycle, step loop, checkpoints, artifact), engine construction
(`build`), named step statistics (`stats`), checkpoints (`checkpoint`)."""
