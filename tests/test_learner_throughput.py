"""What keeps a GPU learner step busy and within memory: figures summed on the device and read once, the decoder
layers compiled (grpo.compile_layers) into one shared graph, AdamW's fused kernel on a GPU and not on CPU, and layer
activations recomputed in the backward pass (grpo.gradient_checkpointing)."""

import pytest
import torch

from conftest import REPO, learner_samples, learner_settings
from refiner_core.learners.torch_learner import (
    DeviceSums,
    TorchLearner,
    compile_decoder_layers,
    load_learner_models,
)
from refiner_core.models import load_model


def test_device_sums_equal_the_figures_read_one_at_a_time():
    """The update's totals were float sums of .item() per micro-batch; summed in float64 on the device they are the
    same numbers, bit for bit (fp32 figures of very different sizes, where an fp32 sum would round)."""
    g = torch.Generator().manual_seed(3)
    figures = [
        (torch.randn(50, generator=g) * 10.0 ** torch.randint(-6, 7, (50,), generator=g)).sum() for _ in range(40)
    ]
    sums = DeviceSums()
    by_item = 0.0
    for x in figures:
        sums.add("loss", x)
        by_item += x.item()
    assert sums.read() == {"loss": by_item}
    assert DeviceSums().read() == {}
    fp32 = torch.stack(figures).sum().item()
    assert fp32 != by_item  # the case can tell a float32 sum apart


@pytest.mark.parametrize("recompute", [False, True])
def test_compiled_layers_share_one_graph_and_train_as_eager(tiny_model_path, recompute):
    """Two decoder layers compile into one graph (one per layer would be two); two updates from the same weights
    agree with eager to rounding, also with the compiled layers recomputed in the backward pass
    (grpo.gradient_checkpointing). Measured: losses within 2e-7 relative, weights within 3e-4 after two AdamW steps
    at lr 1e-2 (which turns rounding-sized gradient differences into steps)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    settings = learner_settings(micro_batch_size=8, tis_cap=2.0, gradient_checkpointing=recompute)
    results = {}
    for compiled in (False, True):
        policy, reference = load_learner_models(tiny_model_path, tiny_model_path, "float32", settings)
        if compiled:
            torch._dynamo.reset()
            counters.clear()
            assert compile_decoder_layers(policy) == policy.config.num_hidden_layers == 2
        learner = TorchLearner(policy, reference, 0, settings)
        losses = [learner.train_step(learner_samples())["loss"] for _ in range(2)]
        results[compiled] = losses, [p.detach().clone() for p in policy.parameters()]
    assert counters["stats"]["unique_graphs"] == 1
    (eager, eager_weights), (fused, fused_weights) = results[False], results[True]
    assert fused == pytest.approx(eager, rel=1e-5)
    assert max((a - b).abs().max().item() for a, b in zip(eager_weights, fused_weights)) < 1e-3
    assert "_orig_mod" not in "".join(policy.state_dict())  # checkpoints keep the model's own names


def test_compile_finds_no_layers_in_a_model_without_them():
    model = torch.nn.Linear(4, 4)
    model.config = type("Config", (), {"num_hidden_layers": 3})()
    with pytest.raises(ValueError, match="no list of 3 decoder layers found in Linear"):
        compile_decoder_layers(model)


def test_fused_adamw_is_for_gpus_and_a_gpu_runs_state_loads_on_cpu(tiny_model_path, tmp_path):
    """On CPU the per-tensor AdamW keeps runs' figures as they were; optimizer state saved by a GPU run (fused) and
    resumed on a CPU runs the CPU's kernel, with the saved moments."""
    policy = load_model(tiny_model_path, trainable=True)
    learner = TorchLearner(policy, None, 0, learner_settings(beta=0.0))
    assert [g["fused"] for g in learner.optimizer.param_groups] == [None]
    learner.train_step(learner_samples())
    state = learner.optimizer.state_dict()
    state["param_groups"][0]["fused"] = True  # as a GPU run saves it
    torch.save(state, tmp_path / "optimizer.pt")
    resumed = TorchLearner(policy, None, 0, learner_settings(beta=0.0), optimizer_state=tmp_path / "optimizer.pt")
    assert [g["fused"] for g in resumed.optimizer.param_groups] == [None]
    first = next(iter(resumed.optimizer.state.values()))
    assert int(first["step"]) == 1
    resumed.train_step(learner_samples())
    assert int(next(iter(resumed.optimizer.state.values()))["step"]) == 2


@pytest.mark.parametrize("lora", [False, True])
def test_recomputed_activations_give_the_same_update_and_keep_less(tiny_model_path, lora):
    """The same loss and gradients (full weights, and LoRA adapters on a frozen base) with the layers' activations
    recomputed in the backward pass; autograd then saves 0.28x the bytes outside the layers on the tiny model
    (bench/learner_memory.py on SmolLM2: 0.12x, and 0.47x the peak memory growth)."""
    import sys

    sys.path.insert(0, str(REPO / "bench"))
    from learner_memory import SavedBytes

    lora_fields = {"lora_rank": 8, "lora_alpha": 16.0} if lora else {}
    results = {}
    for recompute in (False, True):
        settings = learner_settings(micro_batch_size=8, tis_cap=2.0, gradient_checkpointing=recompute, **lora_fields)
        policy, reference = load_learner_models(tiny_model_path, tiny_model_path, "float32", settings)
        assert policy.is_gradient_checkpointing == recompute
        learner = TorchLearner(policy, reference, 0, settings)
        with SavedBytes(policy) as saved:
            loss = learner.train_step(learner_samples())["loss"]
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
        results[recompute] = loss, grads, saved.total
    (loss, grads, kept), (loss_again, grads_again, recomputed) = results[False], results[True]
    assert loss_again == pytest.approx(loss, rel=1e-6) and grads.keys() == grads_again.keys() and grads
    assert all(torch.allclose(grads[n], grads_again[n], rtol=1e-5, atol=1e-8) for n in grads)
    assert recomputed < 0.5 * kept
    with pytest.raises(ValueError, match="gradient_checkpointing needs grpo.share_prompt false"):
        TorchLearner(policy, reference, 0, learner_settings(share_prompt=True, gradient_checkpointing=True))


def test_chunked_logits_score_as_whole_ones_and_keep_less(tiny_model_path):
    """grpo.logit_chunk_tokens: log-probs, entropies and their gradients as the whole logits give them (chunks of 5
    over 9-17 scored positions: a short last chunk), with less saved for backward; a pass scoring nothing still
    backpropagates; a model whose output layer may do more than project is refused."""
    import sys

    sys.path.insert(0, str(REPO / "bench"))
    from learner_memory import SavedBytes

    from refiner_core.learners.batching import collate_rows
    from refiner_core.learners.logprobs import token_scores

    batch = collate_rows([[s] for s in learner_samples()[:4]], 0)
    results = {}
    for chunk in (0, 5):
        model = load_model(tiny_model_path, trainable=True)
        with SavedBytes(model) as saved:
            logp, entropy = token_scores(model, batch, 0.7, "fp32", entropy=True, chunk=chunk)
        ((logp * batch["mask"]).sum() + (entropy * batch["mask"]).sum()).backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results[chunk] = logp, entropy, grads, saved.total
    (logp, entropy, grads, whole), (logp_c, entropy_c, grads_c, chunked) = results[0], results[5]
    assert torch.allclose(logp_c, logp, atol=1e-6) and torch.allclose(entropy_c, entropy, atol=1e-6)
    assert ((grads_c - grads).norm() / grads.norm()).item() < 1e-6  # measured 6e-8: the sums' order
    assert chunked < 0.8 * whole  # measured 0.65 on the tiny model's 2048-token vocabulary
    head = model.get_output_embeddings()
    assert "forward" not in vars(head)  # the class's forward again after the chunked pass
    wrapped = head.forward  # a forward set on the instance before (accelerate's hooks set one) comes back
    head.forward = wrapped
    token_scores(model, batch, 0.7, "fp32", chunk=5)
    assert vars(head)["forward"] is wrapped
    nothing = dict(batch, mask=torch.zeros_like(batch["mask"]))
    logp_none, _ = token_scores(model, nothing, 0.7, "fp32", chunk=5)
    assert logp_none.requires_grad
    model.config.model_type = "gemma2"  # soft-caps its logits after the projection
    with pytest.raises(ValueError, match="output layer of a 'gemma2' model may do more than a projection"):
        token_scores(model, batch, 0.7, "fp32", chunk=5)
    model.config.model_type = "qwen3"
    model.set_output_embeddings(torch.nn.Sequential(model.get_output_embeddings()))
    with pytest.raises(ValueError, match="output layer is a Sequential, not a plain Linear"):
        token_scores(model, batch, 0.7, "fp32", chunk=5)


@pytest.mark.parametrize("frozen_weight", [False, True])
def test_chunked_output_scores_backward_is_the_float64_derivative(frozen_weight):
    """ChunkedOutputScores' hand-written backward against finite differences in float64 (torch's gradcheck): the
    hidden states', weight's and bias's gradients of the log-probs and entropies at a temperature, 7 positions in
    chunks of 3; a frozen weight (LoRA's base) gets no gradient."""
    from refiner_core.learners.logprobs import ChunkedOutputScores

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 7, 5, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(11, 5, dtype=torch.float64, generator=g, requires_grad=not frozen_weight)
    bias = torch.randn(11, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 11, (2, 7), generator=g)

    def scores(h, w, b):
        return ChunkedOutputScores.apply(h, w, b, targets, 0.7, True, 3, torch.float64)

    assert torch.autograd.gradcheck(scores, (hidden, weight, bias))
    logp, entropy = scores(hidden, weight, bias)
    whole = (hidden @ weight.T + bias) / 0.7
    reference = torch.log_softmax(whole, -1)
    assert torch.allclose(logp, reference.gather(-1, targets.unsqueeze(-1)).squeeze(-1), atol=1e-12)
    assert torch.allclose(entropy, -(reference.exp() * reference).sum(-1), atol=1e-12)
    (logp.sum() + entropy.sum()).backward()
    assert (weight.grad is None) == frozen_weight and hidden.grad is not None and bias.grad is not None


def test_chunked_logits_in_bf16_score_as_whole_ones(tiny_model_path):
    """Under bf16 autocast the chunks' logits are the bf16 products autocast's linear gives: log-probs as the whole
    logits give them, gradients within bf16 rounding."""
    from refiner_core.learners.batching import collate_rows
    from refiner_core.learners.logprobs import token_scores

    batch = collate_rows([[s] for s in learner_samples()[:4]], 0)
    results = {}
    for chunk in (0, 5):
        model = load_model(tiny_model_path, trainable=True)
        logp, entropy = token_scores(model, batch, 0.7, "bf16", entropy=True, chunk=chunk)
        ((logp * batch["mask"]).sum() + 0.1 * (entropy * batch["mask"]).sum()).backward()
        results[chunk] = logp, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    (logp, grads), (logp_c, grads_c) = results[0], results[5]
    assert torch.allclose(logp_c, logp, atol=1e-5)
    assert ((grads_c - grads).norm() / grads.norm()).item() < 1e-2  # measured 1.1e-3: bf16 products summed apart


ADAPTERS = dict(lora_rank=4, lora_alpha=8.0, lora_dropout=0.0, lora_target_modules=("all-linear",))


@pytest.mark.parametrize("layout", [{}, ADAPTERS, {"pack_length": 64}], ids=["full", "lora", "packed"])
def test_a_learner_with_chunked_logits_updates_as_one_without(tiny_model_path, layout):
    """The whole update (TIS, an entropy bonus, the reference pass) with logits in chunks of 4; with LoRA the
    output layer's weight is frozen and gets no gradient; packs of several sequences (the GPU recipes' layout)."""
    adapters = "lora_rank" in layout
    results = {}
    for chunk in (0, 4):
        settings = learner_settings(
            micro_batch_size=4, tis_cap=2.0, logit_chunk_tokens=chunk, entropy_coef=0.01, **layout
        )
        policy, reference = load_learner_models(tiny_model_path, tiny_model_path, "float32", settings)
        metrics = TorchLearner(policy, reference, 0, settings).train_step(learner_samples())
        results[chunk] = metrics, [p.detach().clone() for p in policy.parameters()]
        assert (policy.get_output_embeddings().weight.grad is None) == adapters
    (whole, weights), (chunked, weights_c) = results[0], results[4]
    assert chunked["loss"] == pytest.approx(whole["loss"], rel=1e-5, abs=1e-8)
    assert chunked["entropy"] == pytest.approx(whole["entropy"], rel=1e-6)
    # measured 6e-6: AdamW at lr 1e-2 turns rounding-sized gradient differences into up to 0.06 % of a step
    assert max((a - b).abs().max().item() for a, b in zip(weights, weights_c)) < 1e-4


def test_output_layer_bench_compares_chunks_with_whole_logits():
    """bench/output_layer_memory.py on a small shape: each setting in its own process, the chunks' gradients those
    of the whole logits, ratios printed."""
    import json
    import subprocess
    import sys

    args = ["--rows", "2", "--positions", "48", "--vocab", "512", "--hidden", "32", "--chunks", "16", "--threads", "1"]
    done = subprocess.run(
        [sys.executable, "bench/output_layer_memory.py", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["whole"]["grad_gap"] == 0.0 and report["chunks_of_16"]["grad_gap"] < 1e-6
    assert set(report["to_whole"]["chunks_of_16"]) == {"peak_rss_growth", "cpu_seconds"}
