"""Exact resume: a run of every stage SIGKILLed after a checkpoint and resumed ends with the weights and metrics of
the uninterrupted run, in one process and in two (the resume rules — a new lr, refused changes, the checkpoint's
contents, a new --max-steps — and the helpers: test_resume.py). A file of its own so that the test runner's workers
(one file each at a time) spread the two files' ~3 minutes."""

import pytest

from align.tools.sandbox import isolation
from tests.test_resume import STAGES, check_resume, stage_inputs


@pytest.fixture(scope="module")
def inputs(tiny_model_dir, tiny_reward_model_dir, tmp_path_factory):
    return stage_inputs(tiny_model_dir, tiny_reward_model_dir, tmp_path_factory.mktemp("resume_data"))


@pytest.mark.parametrize("stage", list(STAGES))
def test_resume_after_sigkill_equals_an_uninterrupted_run(stage, inputs, tmp_path):
    if stage == "grpo-env" and isolation() is None:
        pytest.skip("this machine cannot isolate a process's network: no user environment runs")
    check_resume(stage, inputs, tmp_path)


# two processes: ZeRO-3 (fp32, sharded moments, each rank's RNG and sampler position) through grpo, the stage with the
# most state beside the weights (SFT's data order and checkpoint take the same engine path: one process above);
# grpo-stale: 1 trainer + 1 decoder rank
@pytest.mark.parametrize("stage", ["grpo", "grpo-stale"])
def test_two_process_resume_after_sigkill_equals_an_uninterrupted_run(stage, inputs, tmp_path):
    check_resume(stage, inputs, tmp_path, nproc=2)
