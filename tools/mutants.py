#!/usr/bin/env python3
"""Mutation campaign: does the test suite notice a realistic bug?

Each mutant is one plausible single-point bug, given as (file, exact original snippet, replacement). The campaign
copies the working tree (tracked and untracked, non-ignored files) to a scratch directory once, then for each
mutant alone: replaces the snippet there, runs the tests named for it (the fastest likely killer first, ``-x``),
and restores the file. Nothing in the repository is touched.

A mutant is *killed* when its tests fail, *survives* when they pass, and is *stale* when its original snippet is
not in the file exactly as many times as expected (the code moved: fix the mutant, it does not count either way);
a test selection that pytest cannot collect (a renamed test) is reported apart the same way.
The score is killed / (killed + survived).

    python tools/mutants.py                    # the whole campaign (tens of minutes on 2 cores: run it niced)
    python tools/mutants.py --list             # the mutants and their tests
    python tools/mutants.py --check            # which mutants are stale, without running tests
    python tools/mutants.py --only rotary-sign,clip-after-adamw
    python tools/mutants.py --baseline         # first run every named test unmutated (must pass)

Not part of CI: it is too slow. Its last report is in docs/testing.md.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Mutant:
    name: str
    area: str
    file: str
    original: str
    replacement: str
    tests: tuple[str, ...]  # pytest arguments (node ids, files, -k expressions), likeliest fast killer first
    why: str = ""  # what real bug this stands for
    occurrences: int = 1  # how many times ``original`` is in the file (identical kernels share lines)
    nth: int = 0  # which occurrence to replace


REF = "tests/test_reference_"
MODEL_LOGITS = REF + "model.py::test_logits_match_numpy_float64_forward"
# One causal case each (the kernels run interpreted on CPU: slow); the Triton interpreter runs every case in one
# subprocess (a module fixture) whichever case is named.
PALLAS_CAUSAL = "tests/test_flash_attention.py::test_pallas_float32_values_and_grads[b1-s64-h4-kv4-d32-causalTrue-None]"
TRITON_CAUSAL = ("tests/test_flash_attention.py::test_triton_kernels_in_triton_interpreter"
                 "[float32-b2-s50-h4-kv2-d64-causalTrue-packed]")

PIPE_SCHEDULE = "tests/test_pipeline.py::test_circular_schedule_matches_sequential_layers"
PIPE_1F1B = "tests/test_pipeline_1f1b.py::test_timetable_moves_each_item_one_stage_per_iteration"
PIPE_1F1B_TOY = "tests/test_pipeline_1f1b.py::test_toy_stack_loss_and_gradients_match_numpy_float64"
MOE_ROUTING = "tests/test_moe_routing_reference.py::"
MOE_FP8 = "tests/test_reference_moe_fp8.py::"

MUTANTS = [
    # -- config --------------------------------------------------------------------------------------------------
    Mutant("auto-cudnn-with-document-mask", "config", "jaxtrain/parallel/layout.py",
           'segments = cfg.data.document_mask or (cfg.data.format == "chat" and cfg.data.pack)',
           'segments = cfg.data.format == "chat" and cfg.data.pack',
           (REF + "config.py",), "auto picks cuDNN, which takes no segment ids, for a document-masked run"),
    Mutant("auto-dtype-bf16-on-tpu-only", "config", "jaxtrain/parallel/layout.py",
           '("float32" if platform == "cpu" else "bfloat16")', '("float32" if platform != "tpu" else "bfloat16")',
           (REF + "config.py",), "GPUs train in float32 under dtype=auto"),
    Mutant("divisibility-ignores-microbatches", "config", "jaxtrain/parallel/dims.py",
           "micro, dp = self.rows_per_microbatch, self.data_parallel", "micro, dp = t.global_batch, self.data_parallel",
           (REF + "config.py::test_each_microbatch_must_split_over_the_data_parallel_devices",),
           "a microbatch that does not split over the data-parallel devices passes validation"),
    Mutant("embed-not-fsdp-sharded", "config", "jaxtrain/config/tree.py",
           '"embed": "fsdp",', '"embed": None,',
           ("tests/test_sharded_training.py::test_fsdp8_holds_an_eighth_of_the_embedding_per_device",),
           "parameters silently replicated: fsdp saves no memory"),
    # -- mesh ----------------------------------------------------------------------------------------------------
    Mutant("mesh-ici-major", "mesh", "jaxtrain/parallel/mesh.py",
           "grid = grid.transpose([k for ax in range(n) for k in (ax, n + ax)])",
           "grid = grid.transpose([k for ax in range(n) for k in (n + ax, ax)])",
           ("tests/test_mesh.py",), "dcn axes laid inside nodes: cross-node traffic on the wrong axis"),
    Mutant("node-coordinates-swapped", "mesh", "jaxtrain/parallel/dims.py",
           "np.stack([coords // ici, coords % ici], axis=-1)", "np.stack([coords % ici, coords // ici], axis=-1)",
           ("tests/test_plan.py::test_node_coordinates_match_build_mesh",),
           "the planner's idea of which device sits on which node differs from build_mesh"),
    # -- model ---------------------------------------------------------------------------------------------------
    Mutant("rotary-sign", "model", "jaxtrain/models/attention.py",
           "x2 * cos + x1 * sin", "x2 * cos - x1 * sin",
           (REF + "model.py::test_rotary_matches_numpy_and_preserves_norms",), "rotation by the wrong sign"),
    Mutant("rotary-frequency", "model", "jaxtrain/models/attention.py",
           "* 2 / dim)", "/ dim)", (REF + "model.py::test_rope_frequencies_match_the_llama_formula",),
           "theta ** -(i / d) instead of -(2i / d): HF checkpoints load but attend wrongly"),
    Mutant("llama3-scaling-inverted", "model", "jaxtrain/models/attention.py",
           "freqs = jnp.where(wavelen > rs.original_max_len / rs.low_freq_factor, freqs / rs.factor,",
           "freqs = jnp.where(wavelen > rs.original_max_len / rs.low_freq_factor, freqs * rs.factor,",
           (REF + "model.py::test_llama3_scaled_frequencies_match_transformers_formula",),
           "long wavelengths compressed instead of stretched"),
    # (An earlier form, reshape(b, s, h // kv, kv, d), is an equivalent mutant: the same reshape when
    # h // kv == kv, a shape error otherwise.)
    Mutant("gqa-interleaved-grouping", "model", "jaxtrain/kernels/flash/reference.py",
           "qg = q.reshape(b, s, kv, h // kv, d)", "qg = q.reshape(b, s, h // kv, kv, d).swapaxes(2, 3)",
           (MODEL_LOGITS,), "query head h reads kv head h % kv (tiled) instead of h // (heads / kv)"),
    Mutant("causal-mask-leaks-next-token", "model", "jaxtrain/kernels/flash/reference.py",
           "mask = jnp.tril(mask)", "mask = jnp.tril(mask, 1)", (MODEL_LOGITS,),
           "each position sees the token it must predict"),
    Mutant("norm-eps-ignored", "model", "jaxtrain/models/llama.py",
           "epsilon=cfg.norm_eps", "epsilon=1e-6", (MODEL_LOGITS,), "model.norm_eps (e.g. Llama's 1e-5) not used"),
    Mutant("swiglu-gate-and-up-swapped", "model", "jaxtrain/models/llama.py",
           "h = nnx.silu(self.gate(x)) * self.up(x)", "h = nnx.silu(self.up(x)) * self.gate(x)", (MODEL_LOGITS,),
           "imported weights put through the wrong nonlinearity"),
    Mutant("mlp-uses-attention-norm", "model", "jaxtrain/models/llama.py",
           "x = x + self.mlp(self.mlp_norm(x))", "x = x + self.mlp(self.attn_norm(x))", (MODEL_LOGITS,),
           "the MLP normalised with the attention's scale"),
    Mutant("kv-cache-sees-own-slot-excluded", "model", "jaxtrain/models/attention.py",
           "return (diff >= 0) if window is None else (diff >= 0) & (diff < window)",
           "return (diff > 0) if window is None else (diff > 0) & (diff < window)",
           ("tests/test_generate.py::test_greedy_matches_transformers_batched_prompts_of_different_lengths",),
           "decoding: a new token does not attend to its own key"),
    Mutant("residual-output-init-unscaled", "model", "jaxtrain/models/llama.py",
           "out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5", "out_std = cfg.init_std",
           (REF + "model.py::test_initial_parameters_follow_the_documented_init",),
           "attention output projections not scaled down with depth (GPT-2 init)", occurrences=2, nth=0),
    Mutant("final-norm-dropped", "model", "jaxtrain/models/llama.py",
           "x = self.final_norm(x)", "x = x", (MODEL_LOGITS,), "no final RMSNorm before the output projection"),
    # -- data ----------------------------------------------------------------------------------------------------
    Mutant("overlapping-windows", "data", "jaxtrain/data/tokens.py",
           "start = int(i) * self.seq_len", "start = int(i) * (self.seq_len // 2)",
           (REF + "data.py::test_windows_have_stride_seq_len_and_share_one_token",),
           "training windows overlap by half: each token seen twice per epoch"),
    Mutant("window-count-off-by-one", "data", "jaxtrain/data/tokens.py",
           "return (len(self.tokens) - 1) // self.seq_len", "return len(self.tokens) // self.seq_len",
           (REF + "data.py::test_windows_have_stride_seq_len_and_share_one_token",),
           "a short last window when the stream is a whole number of strides"),
    Mutant("eos-in-next-document", "data", "jaxtrain/train/step.py",
           "return jnp.cumsum(is_eos, axis=1) - is_eos", "return jnp.cumsum(is_eos, axis=1)",
           (REF + "data.py", "-k", "document_segments"), "the eos token attends to the next document, not its own"),
    Mutant("eval-on-training-windows", "data", "jaxtrain/data/tokens.py",
           "grain.MapDataset.source(Windows(tokens.eval, cfg.seq_len)).repeat()",
           "grain.MapDataset.source(Windows(tokens.train, cfg.seq_len)).repeat()",
           (REF + "data.py::test_eval_batches_are_the_held_out_windows_in_order_wrapping_around",),
           "held-out loss measured on training data"),
    Mutant("process-rows-stride", "data", "jaxtrain/data/tokens.py",
           "base = int(step) * global_batch", "base = int(step) * (hi - lo)",
           (REF + "data.py::test_a_process_reads_exactly_its_rows_of_each_global_batch",),
           "with several processes, each steps through the stream by its own row count: rows repeat"),
    Mutant("shuffle-ignores-seed", "data", "jaxtrain/data/tokens.py",
           ".shuffle(seed=seed)", ".shuffle(seed=0)",
           (REF + "data.py::test_each_epoch_visits_every_window_once_in_a_seeded_order",), "train.seed ignored"),
    # -- train step ----------------------------------------------------------------------------------------------
    Mutant("decay-on-norm-scales", "train", "jaxtrain/optim/state.py",
           "lambda path, _: not any(", "lambda path, _: True or not any(",
           (REF + "optim.py::test_make_optimizer_is_clip_then_adamw_without_decay_on_norm_scales",),
           "weight decay pulls RMSNorm scales towards 0"),
    Mutant("clip-after-adamw", "train", "jaxtrain/optim/state.py",
           "optax.chain(optax.clip_by_global_norm(t.grad_clip), adamw)",
           "optax.chain(adamw, optax.clip_by_global_norm(t.grad_clip))",
           (REF + "optim.py::test_make_optimizer_is_clip_then_adamw_without_decay_on_norm_scales",),
           "the update, not the gradient, is clipped"),
    Mutant("schedule-zero-based", "train", "jaxtrain/optim/state.py",
           "return lambda count: base(count + 1)", "return lambda count: base(count)",
           (REF + "optim.py::test_schedule_values_at_given_steps",), "the first step runs at lr 0"),
    Mutant("targets-not-shifted", "train", "jaxtrain/train/step.py",
           "inputs, targets, segments, positions = tokens[:, :-1], tokens[:, 1:], None, None",
           "inputs, targets, segments, positions = tokens[:, :-1], tokens[:, :-1], None, None",
           (REF + "model.py::test_eval_loss_is_next_token_cross_entropy_of_the_reference_logits",),
           "the model learns to copy its input"),
    Mutant("document-mask-unused", "train", "jaxtrain/train/step.py",
           "segments = document_segments(inputs, self.cfg.data.eos_id)", "segments = None",
           (REF + "model.py::test_eval_loss_is_next_token_cross_entropy_of_the_reference_logits",),
           "data.document_mask=true accepted but not applied"),
    Mutant("microbatches-contiguous", "train", "jaxtrain/train/step.py",
           "micro = batch.reshape(b // k, k, -1).swapaxes(0, 1)", "micro = batch.reshape(k, b // k, -1)",
           (REF + "flops.py::test_microbatch_split_moves_no_data_between_devices",),
           "each microbatch is a contiguous block of rows: data moves between devices every microbatch"),
    # -- pipeline ------------------------------------------------------------------------------------------------
    Mutant("pipeline-ring-backwards", "pipeline", "jaxtrain/parallel/pipeline.py",
           "ring = [(i, (i + 1) % s_n) for i in range(s_n)]", "ring = [(i, (i - 1) % s_n) for i in range(s_n)]",
           (PIPE_SCHEDULE,), "activations handed to the previous stage: layers run out of order"),
    Mutant("pipeline-parks-in-the-wrong-slot", "pipeline", "jaxtrain/parallel/pipeline.py",
           "slot = (t - s_n + 1) % m_n", "slot = (t - s_n) % m_n",
           (PIPE_SCHEDULE,), "a microbatch back from the last stage overwrites another's buffer slot"),
    Mutant("pipeline-pass-from-iteration", "pipeline", "jaxtrain/parallel/pipeline.py",
           "v = jnp.clip(w // m_n, 0, virtual - 1)",
           "v = jnp.clip(t // m_n, 0, virtual - 1)",
           (PIPE_SCHEDULE,), "a stage picks its chunk by the iteration, not its work item's pass"),
    Mutant("pipeline-no-chunk-exchange", "pipeline", "jaxtrain/parallel/pipeline.py",
           "for c in [d * virtual + j]]", "for c in [d * stages + j]]",
           ("tests/test_pipeline.py::test_exchange_rounds_are_permutations_that_move_every_chunk_once",
            PIPE_SCHEDULE), "interleaved chunks taken from the wrong storage slots"),
    Mutant("pipeline-loss-mean-over-stages", "train", "jaxtrain/train/step.py",
           "(shares, targets).sum() / k", "(shares, targets).sum() / stages",
           ("tests/test_pipeline.py::test_pipelined_losses_match_single_device",),
           "the pipelined loss (and so its gradients) scaled by microbatches / stages"),
    Mutant("pipeline-microbatches-any-count", "config", "jaxtrain/parallel/dims.py",
           "t.microbatches >= stages and t.microbatches % stages == 0", "t.microbatches >= 1",
           ("tests/test_cli.py::test_bad_input_exits_2_with_one_line",),
           "fewer microbatches than stages (or not a multiple) reach the step and fail inside XLA"),
    Mutant("1f1b-one-slot-short", "pipeline", "jaxtrain/parallel/pipeline_1f1b.py",
           "return min(2 * stages * virtual - 1, microbatches * virtual)",
           "return min(2 * stages * virtual - 2, microbatches * virtual)",
           (PIPE_1F1B, PIPE_1F1B_TOY), "the saved-input buffer one slot short: stage 0's oldest input overwritten"),
    Mutant("1f1b-cotangent-ring-forwards", "pipeline", "jaxtrain/parallel/pipeline_1f1b.py",
           "backward_ring = [((i + 1) % s_n, i) for i in range(s_n)]",
           "backward_ring = [(i, (i + 1) % s_n) for i in range(s_n)]",
           (PIPE_1F1B_TOY,), "cotangents sent on to the next stage instead of back to the previous one"),
    Mutant("1f1b-embedding-grad-every-pass", "pipeline", "jaxtrain/parallel/pipeline_1f1b.py",
           "b_ok & (me == 0) & (v_b == 0), embed_grad", "b_ok & (me == 0), embed_grad",
           (PIPE_1F1B_TOY,), "stage 0's input cotangent of every pass, not only the first, reaches the embedding"),
    Mutant("1f1b-grads-summed-over-groups", "pipeline", "jaxtrain/models/sidestate.py",
           "return (jax.lax.psum(g, over) if over else g) / groups",
           "return (jax.lax.psum(g, over) if over else g)",
           (PIPE_1F1B_TOY,), "layer gradients summed, not averaged, over the data-parallel groups"),
    Mutant("accumulate-modes-swapped", "train", "jaxtrain/train/step.py",
           'if self.cfg.train.accumulate == "sharded" or not dp_axes:',
           'if self.cfg.train.accumulate == "unreduced" or not dp_axes:',
           (REF + "flops.py::test_unreduced_accumulation_reduces_gradients_once_per_step",),
           "same numbers, but gradients reduced every microbatch: accumulation's saving silently lost"),
    Mutant("unreduced-grads-not-averaged-over-groups", "train", "jaxtrain/models/sidestate.py",
           "lambda p, g: r.reduce(g, axis) if (r := rule_of(p)) else g.sum(axis)",
           "lambda p, g: r.reduce(g, axis) if (r := rule_of(p)) else g.mean(axis)",
           (REF + "optim.py", "-k", "microbatches-unreduced"),
           "groups' gradients averaged although each is already its share of the step: dp times too small"),
    Mutant("sharded-grads-not-averaged", "train", "jaxtrain/train/step.py",
           "trained = self._trained_tokens(batch)  #", "trained = self._trained_tokens(batch) / k  #",
           (REF + "optim.py", "-k", "microbatches-sharded"),
           "each microbatch normalised by its own share of tokens: loss and gradients k times too large"),
    # -- checkpoint ----------------------------------------------------------------------------------------------
    Mutant("last-step-not-saved", "checkpoint", "jaxtrain/checkpoint/format.py",
           "return step == self.cfg.train.steps or (every > 0 and step % every == 0)",
           "return every > 0 and step % every == 0",
           ("tests/test_checkpoint.py::test_save_schedule_and_retention[0-3-expected0]",),
           "a run's final state is lost"),
    Mutant("keeps-one-too-many", "checkpoint", "jaxtrain/checkpoint/orbax_io.py",
           "LatestN(c.keep)", "LatestN(c.keep + 1)",
           ("tests/test_checkpoint.py::test_save_schedule_and_retention[2-2-expected1]",),
           "checkpoint.keep off by one"),
    Mutant("local-peer-copy-of-the-wrong-process", "checkpoint", "jaxtrain/checkpoint/local.py",
           "s in own[j] or (n > 1 and s in peer[(j + 1) % n])", "s in own[j] or (n > 1 and s in peer[(j - 1) % n])",
           ("tests/test_local_checkpoint.py",),
           "a local step counted as restorable from a peer that holds another process's shards"),
    Mutant("local-shard-layout-of-this-process", "checkpoint", "jaxtrain/checkpoint/local.py",
           "if device.process_index == process:", "if device.process_index == jax.process_index():",
           ("tests/test_local_checkpoint.py",),
           "every process's blob laid out as this process's: a peer copy unpacked into the wrong shards"),
    Mutant("resume-drops-checkpointed-step-record", "checkpoint", "jaxtrain/rundir.py",
           'if r["step"] <= last_step]', 'if r["step"] < last_step]',
           ("tests/test_checkpoint.py::test_sigkill_then_resume_is_bit_exact",),
           "after a resume, metrics.jsonl lacks the checkpointed step's record"),
    Mutant("hf-import-ignores-norm-eps", "checkpoint", "jaxtrain/hf/mapping.py",
           '"model.norm_eps": hf.get("rms_norm_eps", 1e-6),', '"model.norm_eps": 1e-6,',
           ("tests/test_hf.py::test_import_logits_match_transformers_and_round_trip",),
           "an imported Llama 2 (rms_norm_eps 1e-5) runs with transformers' default 1e-6"),
    # -- distributed ---------------------------------------------------------------------------------------------
    Mutant("slurm-process-id-from-localid", "distributed", "jaxtrain/cluster/distributed.py",
           'n, i = int(slurm_tasks), _env_int(environ, "SLURM_PROCID")',
           'n, i = int(slurm_tasks), _env_int(environ, "SLURM_LOCALID")',
           (REF + "env.py",), "every node's task 0 claims process id 0"),
    Mutant("slurm-job-task-count-first", "distributed", "jaxtrain/cluster/distributed.py",
           'environ.get("SLURM_STEP_NUM_TASKS", environ.get("SLURM_NTASKS", "1"))',
           'environ.get("SLURM_NTASKS", environ.get("SLURM_STEP_NUM_TASKS", "1"))',
           (REF + "env.py",), "a step smaller than the job waits forever for processes that never come"),
    Mutant("shared-gpus-by-local-id", "distributed", "jaxtrain/cluster/distributed.py",
           "ids = tuple(range(local * per, (local + 1) * per))", "ids = tuple(range(local, local + per))",
           (REF + "env.py",), "tasks sharing a node's GPUs overlap"),
    # -- metrics / FLOPs -----------------------------------------------------------------------------------------
    Mutant("flops-omit-attention", "metrics", "jaxtrain/models/flops.py",
           "return 3 * (2 * matmul_weights + attention_flops_per_token(cfg, seq_len))", "return 3 * 2 * matmul_weights",
           (REF + "flops.py::test_train_flops_per_token_equals_the_hand_count",), "MFU without attention"),
    Mutant("flops-attention-not-halved", "metrics", "jaxtrain/models/flops.py",
           "return cfg.n_layers * 2 * seq_len * cfg.n_heads * (cfg.qk_head_dim + v_dim) / 2",
           "return cfg.n_layers * 2 * seq_len * cfg.n_heads * (cfg.qk_head_dim + v_dim)",
           (REF + "flops.py::test_train_flops_per_token_equals_the_hand_count",),
           "causal attention counted in full: MFU inflated"),
    Mutant("tflops-not-per-device", "metrics", "jaxtrain/observe/metrics.py",
           "return self.flops_per_step / step_seconds / self.num_devices / 1e12",
           "return self.flops_per_step / step_seconds / 1e12",
           ("tests/test_sharded_training.py::test_losses_match_single_device[fsdp=8]",),
           "TFLOP/s per device reported for the whole job"),
    Mutant("h200-sparse-peak", "metrics", "jaxtrain/configs/hardware/h200-8x.yaml",
           "peak_flops: 989.4e+12", "peak_flops: 1979.0e+12",
           (REF + "config.py::test_peak_flops_per_device_kind_are_the_dense_bf16_datasheet_numbers",),
           "MFU against the 2:4-sparsity peak: halved"),
    # -- planner -------------------------------------------------------------------------------------------------
    Mutant("planner-all-reduce-bytes-halved", "planner", "jaxtrain/planner/cost/model.py",
           "return 2 * size * (a - 1) / a, 2 * size / a * (b - 1) / b",
           "return size * (a - 1) / a, size / a * (b - 1) / b",
           ("tests/test_plan.py::test_group_span_and_hierarchical_link_bytes",),
           "all-reduce priced as one all-gather"),
    Mutant("planner-ignores-compute-efficiency", "planner", "jaxtrain/planner/cost/model.py",
           "return table.get((remat, t), hw.compute_efficiency)",
           "return table.get((remat, t), 1.0)",
           (REF + "planner.py", "tests/test_plan.py"), "predicted step times assume 100% of peak"),
    Mutant("planner-remat-free", "planner", "jaxtrain/planner/cost/model.py",
           "return 4 / 3  # forward + backward", "return 1.0  # forward + backward",
           (REF + "planner.py", "tests/test_plan.py"), "full rematerialisation predicted to cost nothing"),
    # -- kernels -------------------------------------------------------------------------------------------------
    Mutant("pallas-causal-off-by-one", "kernels", "jaxtrain/kernels/flash/pallas_tiles.py",
           "mask = _and(mask, q_(q_pos) >= k_(k_pos))", "mask = _and(mask, q_(q_pos) > k_(k_pos))",
           (PALLAS_CAUSAL,), "a token does not attend to itself (first row all masked)"),
    Mutant("pallas-diagonal-tile-unmasked", "kernels", "jaxtrain/kernels/flash/pallas_tiles.py",
           "full = jnp.minimum(lax.div(first + 1, block_k), end)", "full = end",
           (PALLAS_CAUSAL,), "diagonal tiles treated as wholly visible: future keys leak"),
    Mutant("triton-fwd-causal-off-by-one", "kernels", "jaxtrain/kernels/flash/triton_kernels.py",
           "valid = valid & (offs_q[:, None] >= offs_k[None, :])",
           "valid = valid & (offs_q[:, None] > offs_k[None, :])",
           (TRITON_CAUSAL,), "forward and dq kernels' diagonal mask off by one (their shared _key_tile_src)"),
    Mutant("triton-dkdv-causal-off-by-one", "kernels", "jaxtrain/kernels/flash/triton_kernels.py",
           "valid = valid & (offs_q[None, :] >= pos_k[:, None])",
           "valid = valid & (offs_q[None, :] > pos_k[:, None])",
           (TRITON_CAUSAL,), "dk/dv kernel's diagonal mask off by one"),
    # -- MoE and FP8 (issue 40: each of these passed the default suite before its test) ----------------------------
    Mutant("moe-padding-routed", "moe", "jaxtrain/models/routing.py",
           "if routed is not None:  # not routed", "if False:  # not routed",
           (MOE_ROUTING + "test_padding_takes_no_slot_and_counts_nowhere",
            MOE_ROUTING + "test_chat_padding_is_flagged_and_never_routed_through_the_step"),
           "padding routed: it takes capacity slots and counts in the balance loss, z-loss and load figures"),
    Mutant("moe-step-drops-the-padding-mask", "moe", "jaxtrain/train/step.py",
           "sidestate.forward(model, self.cfg.model, inputs, segments, positions, routed)",
           "sidestate.forward(model, self.cfg.model, inputs, segments, positions)",
           (MOE_ROUTING + "test_chat_padding_is_flagged_and_never_routed_through_the_step",),
           "the step never tells the router which positions are padding"),
    Mutant("moe-balance-forms-swapped", "moe", "jaxtrain/models/routing.py",
           'if form == "pooled":', 'if form != "pooled":',
           (MOE_ROUTING + "test_balance_loss_forms_equal_numpy",),
           "the pooled balance loss where the per-layer one is asked for (layers' collapses cancel)"),
    Mutant("moe-z-loss-takes-aux-weight", "moe", "jaxtrain/models/moe.py",
           "moe.aux_loss * balance + moe.z_loss * z", "moe.aux_loss * balance + moe.aux_loss * z",
           (MOE_ROUTING + "test_loss_weights_are_each_terms_own",), "the z-loss weighted by aux_loss"),
    Mutant("moe-slots-floor", "moe", "jaxtrain/models/routing.py",
           "return min(seq, math.ceil(exact))", "return min(seq, math.floor(exact))",
           (MOE_FP8 + "test_capacity_slots_by_hand",), "capacity slots rounded down: assignments dropped early"),
    Mutant("moe-keep-token-major", "moe", "jaxtrain/models/routing.py",
           "flat = experts.transpose(0, 2, 1).reshape(b, k * s)", "flat = experts.reshape(b, k * s)",
           (MOE_FP8 + "test_keep_mask_on_a_hand_built_routing",),
           "a token's second choice served before others' first"),
    Mutant("planner-counts-active-experts", "planner", "jaxtrain/planner/cost/memory.py",
           'return counts["total"] - counts["experts"]', 'return counts["active"] - counts["experts"]',
           (MOE_FP8 + "test_planner_counts_every_experts_parameters",),
           "the planner's memory from active, not total, parameters"),
    Mutant("planner-cpu-rows-unwidened", "planner", "jaxtrain/planner/cost/memory.py",
           'per_row = 2 * act + (16 if compiler == "xla-cpu" else act)',
           'per_row = 2 * act + (8 if compiler == "xla-cpu" else act)',
           ("tests/test_planner_moe_memory.py::test_deepseek_v3_stack_closed_form_is_within_a_tenth_of_xla_cpu",),
           "XLA:CPU's float32-widened expert rows left out: DeepSeek-V3's plans 11% under the compiled memory"),
    Mutant("fp8-on-the-output-projection", "fp8", "jaxtrain/models/llama.py",
           "use_fp8(cfg, self.q, self.k, self.v, self.o)", "use_fp8(cfg, self.q, self.k, self.v)",
           (MOE_FP8 + "test_exactly_the_attention_and_mlp_projections_multiply_in_fp8",),
           "the attention output projection left out of FP8"),
    Mutant("fp8-expert-amax-not-over-expert-axis", "fp8", "jaxtrain/parallel/expert.py",
           "tuple(a for a in mesh.axis_names if a in manual)",
           'tuple(a for a in mesh.axis_names if a in manual and a != "expert")',
           (MOE_FP8 + "test_fp8_experts_on_an_expert_mesh_equal_one_device",),
           "the experts' tensorwise amax of one device's tokens, not the whole tensor's"),
    Mutant("mla-padded-scale-of-the-padded-width", "model", "jaxtrain/models/attention.py",
           "out = self._kernel(pad(q), pad(k), pad(v), segment_ids, 1 / math.sqrt(q.shape[-1]))",
           "out = self._kernel(pad(q), pad(k), pad(v), segment_ids, None)",
           ("tests/test_mla.py::test_the_flash_kernel_takes_mla_padded_to_its_head_dim",),
           "MLA zero-padded for a kernel but scaled by the padded head dim, not q/k's own"),
    Mutant("first-dense-after-the-groups", "model", "jaxtrain/models/moe.py",
           "        if self.first_dense is not None:\n            x = scan_blocks(self.first_dense, x, segment_ids, "
           "positions, self.cfg.remat)\n        graphdef, stacked = nnx.split(self.blocks)",
           "        graphdef, stacked = nnx.split(self.blocks)",
           ("tests/test_moe_first_dense.py::test_the_dense_layers_before_the_groups_equal_a_group_of_every_2",),
           "model.moe.first_dense's layers skipped (or run out of order)"),
    Mutant("fp8-amax-summed", "fp8", "jaxtrain/models/fp8.py",
           "return lax.pmax(a, reduce) if reduce else a", "return lax.psum(a, reduce) if reduce else a",
           (MOE_FP8 + "test_fp8_experts_on_an_expert_mesh_equal_one_device",), "amaxes summed over devices, not maxed"),
    Mutant("fp8-resume-fresh-histories", "checkpoint", "jaxtrain/checkpoint/format.py",
           'return out["state"], step, out["meta"]["data_iterator"]',
           'return {**out["state"], "model": with_fresh_rest(fresh_state()["model"], '
           'params_only(out["state"]["model"]))}, step, out["meta"]["data_iterator"]',
           (MOE_FP8 + "test_delayed_histories_resume_bit_exact",), "a resume restarts the delayed-scaling histories"),
    # -- precision -----------------------------------------------------------------------------------------------
    Mutant("reduce-dtype-float32-rounds-to-bf16", "precision", "jaxtrain/models/precision.py",
           "return vjp(g)[0], dw  #", "return vjp(g)[0], dw.astype(x.dtype).astype(jnp.float32)  #",
           ("tests/test_reduce_dtype.py::test_float32_weight_gradient_matches_float64_with_forward_and_input_"
            "gradient_unchanged",),
           "model.reduce_dtype=float32's weight gradient rounded to the compute dtype: the option does nothing"),
]


def snapshot(dst: str) -> None:
    """Copy the working tree's tracked and untracked (not ignored) files to ``dst``."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = os.path.join(REPO, rel)
        if not os.path.isfile(src) or os.path.islink(src) and not os.path.exists(src):
            continue  # deleted in the working tree, or a dangling link
        target = os.path.join(dst, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if os.path.islink(src):
            os.symlink(os.readlink(src), target)
        else:
            shutil.copy2(src, target)


def check(m: Mutant, root: str) -> str | None:
    """Why the mutant is stale, or None."""
    path = os.path.join(root, m.file)
    if not os.path.isfile(path):
        return f"{m.file} does not exist"
    count = open(path).read().count(m.original)
    if count != m.occurrences:
        return f"original found {count} times in {m.file}, expected {m.occurrences}"
    return None


def mutate(text: str, m: Mutant) -> str:
    parts = text.split(m.original)
    return m.original.join(parts[: m.nth + 1]) + m.replacement + m.original.join(parts[m.nth + 1:])


def run_tests(root: str, args: tuple[str, ...], timeout: int) -> tuple[str, str, float]:
    """(outcome, detail, seconds): outcome "passed", "failed" (detail: first failing test), "error" or "timeout"."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = root
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    # -o addopts=: the project deselects slow tests by default; a mutant may name one on purpose.
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rfE", "-p", "no:cacheprovider", "-o", "addopts=", *args]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", f"> {timeout} s", time.perf_counter() - t0
    seconds = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    if proc.returncode == 0:
        return "passed", "", seconds
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    if proc.returncode == 1 and failed:
        return "failed", failed[0], seconds
    if proc.returncode in (4, 5):  # usage error (a named test that does not exist) or nothing collected
        return "broken", " ".join(out.strip().splitlines()[-1:])[:160], seconds
    tail = " ".join(out.strip().splitlines()[-1:])[:120]
    return "error", f"pytest exit {proc.returncode}: {failed[0] if failed else tail}", seconds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", help="comma-separated mutant names")
    p.add_argument("--list", action="store_true", help="print the mutants and their tests, run nothing")
    p.add_argument("--check", action="store_true", help="report stale mutants only, run no tests")
    p.add_argument("--baseline", action="store_true", help="run every named test set unmutated first")
    p.add_argument("--timeout", type=int, default=900, help="seconds per mutant's test run (default 900)")
    p.add_argument("--keep", action="store_true", help="keep the scratch copy")
    args = p.parse_args(argv)
    mutants = MUTANTS
    if args.only:
        wanted = args.only.split(",")
        unknown = [w for w in wanted if w not in {m.name for m in MUTANTS}]
        if unknown:
            print(f"error: unknown mutant(s) {', '.join(unknown)}; --list shows them", file=sys.stderr)
            return 2
        mutants = [m for m in MUTANTS if m.name in wanted]
    if args.list:
        for m in mutants:
            print(f"{m.name:42s} {m.area:11s} {m.file}: {' '.join(m.tests)}\n{'':42s} {m.why}")
        return 0

    def stop(signum, frame):  # SIGTERM: end the running tests (subprocess.run kills them) and remove the copy
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    root = tempfile.mkdtemp(prefix="jaxtrain-mutants-")
    try:
        snapshot(root)
        stale = {m.name: why for m in mutants if (why := check(m, root))}
        if args.check:
            for m in mutants:
                print(f"{m.name:42s} {'STALE: ' + stale[m.name] if m.name in stale else 'ok'}")
            return 1 if stale else 0
        probe = subprocess.run([sys.executable, "-c", "import jaxtrain; print(jaxtrain.__file__)"],
                               cwd=root, env={**os.environ, "PYTHONPATH": root}, capture_output=True, text=True)
        if not probe.stdout.startswith(root):
            print(f"error: the scratch copy's jaxtrain is not the one imported ({probe.stdout.strip()}"
                  f"{probe.stderr.strip()[-200:]})", file=sys.stderr)
            return 2
        if args.baseline:
            for tests in dict.fromkeys(m.tests for m in mutants if m.name not in stale):
                outcome, detail, sec = run_tests(root, tests, args.timeout)
                print(f"baseline {' '.join(tests)}: {outcome} {detail} ({sec:.0f} s)", flush=True)
                if outcome != "passed":
                    print("error: a baseline test set does not pass unmutated; the campaign would be meaningless",
                          file=sys.stderr)
                    return 1
        rows, broken = [], {}
        header = f"{'mutant':42s} {'area':11s} {'result':9s} {'time':>6s}  caught by"
        print(header + "\n" + "-" * len(header), flush=True)
        for m in mutants:
            if m.name in stale:
                continue
            path = os.path.join(root, m.file)
            original = open(path).read()
            with open(path, "w") as f:
                f.write(mutate(original, m))
            try:
                outcome, detail, sec = run_tests(root, m.tests, args.timeout)
            finally:
                with open(path, "w") as f:
                    f.write(original)
            if outcome == "broken":  # the test selection is wrong, not the code right: counts neither way
                broken[m.name] = detail
                print(f"{m.name:42s} {m.area:11s} {'BROKEN':9s} {sec:5.0f}s  {detail}", flush=True)
                continue
            result = "SURVIVED" if outcome == "passed" else "killed"
            rows.append((m, result, detail, sec))
            print(f"{m.name:42s} {m.area:11s} {result:9s} {sec:5.0f}s  {detail or '-'}", flush=True)
        killed = sum(r[1] == "killed" for r in rows)
        print(f"\nscore: {killed}/{len(rows)} killed ({100 * killed / max(1, len(rows)):.0f}%), "
              f"{len(stale)} stale, {len(broken)} with a broken test selection, "
              f"{sum(r[3] for r in rows):.0f} s of tests")
        for m, result, _, _ in rows:
            if result == "SURVIVED":
                print(f"survivor {m.name}: {m.why}")
        for name, why in stale.items():
            print(f"stale {name}: {why}")
        for name, why in broken.items():
            print(f"broken test selection {name}: {why}")
        return 0
    finally:
        if args.keep:
            print(f"scratch copy kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
