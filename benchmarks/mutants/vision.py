"""Wiring mutations of align/vision.py and its callers: the image tokens a prompt gets, the image tensors a batch
carries and cuts, the images a forward sees, the frozen tower and the tokens never sampled."""

from benchmarks.mutants import Mutation

T = "tests/test_vlm.py::"
TOKENS = (T + "test_an_image_rows_prompt_holds_its_expanded_image_pads_and_the_loss_only_its_completion",)
BATCH = (T + "test_a_batch_concatenates_its_rows_image_patches_and_cuts_into_micro_batches",)
FORWARD = (T + "test_a_padded_batch_gives_each_rows_own_log_probs_and_generation",)
TOWER = (T + "test_the_vision_tower_is_frozen_but_its_merger_and_the_lm_train",)
STAGES = (T + "test_sft_dpo_and_grpo_run_on_image_rows",)

M = Mutation
MUTATIONS: list[Mutation] = [
    M("vision: an image's pads not divided by the merge's area", "align/vision.py",
      "int(t * h * w) // (merge * merge)", "int(t * h * w) // merge", TOKENS),
    M("vision: the prompt of an image row cut through its image tokens", "align/vision.py",
      "    if cut > first:", "    if cut > len(prompt):", TOKENS),
    M("vision: the rejected rows of a pair without their prompt's images", "align/data.py",
      "**vision.collate_images([e[\"prompt_ids\"] for e in examples] * 2)}",
      "**vision.collate_images([e[\"prompt_ids\"] for e in examples])}", BATCH),
    M("vision: a micro-batch takes the first rows' images", "align/vision.py",
      "    imgs = [j for r in rows for j in range(first[r], first[r + 1])]",
      "    imgs = list(range(sum(counts[r] for r in rows)))", BATCH),
    M("vision: the log-prob forward without the images", "align/logprobs.py",
      "    return {**kw, **vision.forward_images(batch), \"use_cache\": False}",
      "    return {**kw, \"use_cache\": False}", FORWARD),
    M("vision: generate without the images", "align/rollout/generation.py",
      "logits_processor=sampler, **vision.generate_images(chunk, device))", "logits_processor=sampler)", FORWARD),
    M("vision: --train-vision's default trains the tower", "align/engine/run.py",
      "with_lora(with_tower(load, cfg.train_vision), cfg)", "with_lora(with_tower(load, True), cfg)", STAGES),
    M("vision: the merger frozen with the tower", "align/vision.py",
      "if not name.startswith(\"merger.\")]", "]", TOWER),
]
