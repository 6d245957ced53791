"""Imported last by the tests' fork server (tests/conftest.py: PRELOAD): moves everything the preloaded imports
created into the garbage collector's permanent generation, so that a full collection in a forked `align` process
(DeepSpeed runs gc.collect() while it builds each ZeRO engine, ~0.5 s over the preloaded heap) walks only what the
process itself made. A forked process is otherwise unchanged: those objects live as long as the process anyway."""

import gc

gc.freeze()
