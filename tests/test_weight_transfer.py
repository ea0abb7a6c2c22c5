"""The CPU-checkable parts of sending weights to a vLLM engine on GPU (refiner_core.runtime.weight_transfer):
buckets, packing in the engine's dtype, the tied output layer, update_info fields both vLLM releases read, merged
IPC handles, the transport chosen, and deltas: exact patches, and their fused runtime form for vLLM 0.26, checked
by applying them as 0.26's sparse engine does (index_copy_ into the fused parameter)."""

from __future__ import annotations

import base64
import pickle
import random
import types

import pytest
import torch

from refiner_core.runtime import weight_transfer as wt


def test_buckets_hold_at_most_their_bytes_in_order_and_a_large_tensor_alone():
    assert wt.plan_buckets([3, 3, 3, 10, 1, 1], 6) == [range(0, 2), range(2, 3), range(3, 4), range(4, 6)]
    assert wt.plan_buckets([7], 6) == [range(0, 1)]
    assert wt.plan_buckets([], 6) == []
    with pytest.raises(ValueError):
        wt.plan_buckets([1], 0)
    rng = random.Random(3)
    for _ in range(50):
        sizes = [rng.randint(1, 40) for _ in range(rng.randint(1, 30))]
        limit = rng.randint(1, 60)
        planned = wt.plan_buckets(sizes, limit)
        assert [i for r in planned for i in r] == list(range(len(sizes)))
        assert all(sum(sizes[i] for i in r) <= limit or len(r) == 1 for r in planned)
        # the streaming form groups a one-at-a-time iterator the same way
        named = [(str(i), torch.empty(s)) for i, s in enumerate(sizes)]
        streamed = [[int(n) for n, _ in b] for b in wt.in_buckets(iter(named), 1, limit)]
        assert streamed == [list(r) for r in planned]


def test_pack_casts_into_one_buffer_of_views_with_the_tensors_shapes():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g), torch.randn(2, 2, 2, generator=g)]
    buffer, views = wt.pack(tensors, torch.bfloat16)
    assert buffer.dtype == torch.bfloat16 and buffer.numel() == 12 + 5 + 8
    for t, v in zip(tensors, views):
        assert v.shape == t.shape and v.dtype == torch.bfloat16
        assert torch.equal(v, t.to(torch.bfloat16))  # the cast vLLM would have made on arrival, bit for bit
        assert v.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()  # one allocation
    info = wt.update_info(["a", "b", "c"], views, extra=1)
    assert info == {
        "names": ["a", "b", "c"],
        "dtype_names": ["bfloat16"] * 3,
        "shapes": [[3, 4], [5], [2, 2, 2]],
        "extra": 1,
    }


def test_a_tied_output_layer_is_sent_under_its_own_name_too():
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    assert wt.output_alias(names, tied=True) == {"lm_head.weight": "model.embed_tokens.weight"}
    assert wt.output_alias(names, tied=False) == {}
    assert wt.output_alias([*names, "lm_head.weight"], tied=True) == {}
    embed = torch.ones(2)
    assert [n for n, _ in wt.with_output([(names[0], embed), (names[1], torch.zeros(1))], tied=True)] == [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]
    assert len(list(wt.with_output([(names[1], torch.zeros(1))], tied=True))) == 1  # nothing to alias


def test_ipc_update_info_carries_the_merged_handles_pickled():
    per_rank = [[{"gpu-0": ("a", 1)}, {"gpu-0": ("b", 2)}], None, [{"gpu-1": ("c", 3)}, {"gpu-1": ("d", 4)}]]
    merged = wt.merge_handles(per_rank)
    assert merged == [{"gpu-0": ("a", 1), "gpu-1": ("c", 3)}, {"gpu-0": ("b", 2), "gpu-1": ("d", 4)}]
    with pytest.raises(ValueError):
        wt.merge_handles([[{"x": 1}], [{"y": 1}, {"y": 2}]])
    views = [torch.zeros(2, dtype=torch.bfloat16), torch.zeros(1, 3, dtype=torch.bfloat16)]
    info = wt.ipc_update_info(["p", "q"], views, merged)
    assert set(info) == {"names", "dtype_names", "shapes", "ipc_handles_pickled"}  # no 'packed': 0.26 and 0.32
    assert pickle.loads(base64.b64decode(info["ipc_handles_pickled"])) == merged
    assert wt.nccl_init_info("10.0.0.1", 29500, 2) == {
        "master_address": "10.0.0.1",
        "master_port": 29500,
        "rank_offset": 1,
        "world_size": 3,
    }


def test_transport_is_host_off_gpu_and_ipc_for_auto_on_gpu():
    assert [wt.choose_transport(t, on_gpu=False) for t in wt.TRANSPORTS] == ["host"] * len(wt.TRANSPORTS)
    assert wt.choose_transport("auto", on_gpu=True) == "ipc"
    assert wt.choose_transport("nccl", on_gpu=True) == "nccl"
    assert wt.BACKENDS["delta"] == "sparse_nccl"
    with pytest.raises(ValueError, match="weight_transfer"):
        wt.choose_transport("rdma", on_gpu=True)
    assert wt.dtype_name(torch.bfloat16) == "bfloat16" and wt.torch_dtype("float32") is torch.float32
    with pytest.raises(ValueError):
        wt.torch_dtype("Tensor")


def test_a_sparse_patch_gives_the_new_tensor_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    old = torch.randn(64, 32, generator=g).to(torch.bfloat16)
    new = old.clone()
    new[3, 4] += 1
    new[10] = 0.5
    new[20, 0] = -0.0 if old[20, 0] == 0 else old[20, 0]  # unchanged value: not in the patch
    indices, values = wt.sparse_patch(old, new)
    assert indices.dtype == torch.int32 and values.dtype == torch.bfloat16
    changed = (old != new).reshape(-1).nonzero().reshape(-1)
    assert torch.equal(indices.long(), changed)
    patched = old.clone().reshape(-1)
    patched.index_copy_(0, indices.long(), values)
    assert torch.equal(patched.view(torch.int16), new.reshape(-1).view(torch.int16))
    zero, negative_zero = torch.zeros(2), torch.tensor([0.0, -0.0])
    assert wt.sparse_patch(zero, negative_zero)[0].tolist() == [1]  # bits, not values
    assert wt.full_patch(new)[0].numel() == new.numel()
    with pytest.raises(ValueError):
        wt.sparse_patch(old, new.float())


def test_runtime_patches_index_the_fused_parameters_as_vllm_026_lays_them_out():
    """q, k, v stacked along dim 0 into qkv_proj and gate, up into gate_up_proj (tensor parallel size 1): a patch
    of a part, shifted by the parts before it and applied with index_copy_ to the fused tensor, gives the fused
    tensor of the new parts exactly."""
    g = torch.Generator().manual_seed(2)
    prefix = "model.layers.0."
    shapes = {
        prefix + "self_attn.q_proj.weight": (8, 4),
        prefix + "self_attn.k_proj.weight": (4, 4),
        prefix + "self_attn.v_proj.weight": (4, 4),
        prefix + "mlp.gate_proj.weight": (6, 4),
        prefix + "mlp.up_proj.weight": (6, 4),
        prefix + "input_layernorm.weight": (4,),
    }
    old = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    new = {n: t + (torch.rand(t.shape, generator=g) < 0.3) * 1.0 for n, t in old.items()}
    # k_proj unchanged: its patch is empty, and v's offset still counts its elements
    new[prefix + "self_attn.k_proj.weight"] = old[prefix + "self_attn.k_proj.weight"].clone()
    patches = wt.runtime_patches({n: wt.sparse_patch(old[n], new[n]) for n in shapes}, shapes)
    fused = {
        prefix + "self_attn.qkv_proj.weight": ["q_proj", "k_proj", "v_proj"],
        prefix + "mlp.gate_up_proj.weight": ["gate_proj", "up_proj"],
    }
    assert set(patches) == {*fused, prefix + "input_layernorm.weight"}
    runtime = wt.runtime_shapes(shapes)
    for name, parts in fused.items():
        full = [n for n in shapes if any(f".{p}." in n for p in parts)]
        before = torch.cat([old[n] for n in full]).reshape(-1)
        before.index_copy_(0, patches[name][0].long(), patches[name][1])
        assert torch.equal(before, torch.cat([new[n] for n in full]).reshape(-1))
        assert runtime[name] == tuple(torch.cat([new[n] for n in full]).shape)
    info = wt.sparse_update_info(patches, runtime)
    assert info["num_updates_list"] == [int(patches[n][0].numel()) for n in info["names"]]
    assert wt.runtime_name("model.layers.3.mlp.down_proj.weight") == ("model.layers.3.mlp.down_proj.weight", -1)
    with pytest.raises(ValueError, match="fused parts"):
        wt.runtime_patches(
            {prefix + "self_attn.q_proj.weight": patches[next(iter(fused))]},
            {
                prefix + "self_attn.q_proj.weight": (8, 4),
                prefix + "self_attn.v_proj.weight": (4, 4),
            },
        )


class _TransferCalls:
    """vLLM's LLM as the engine's weight-transfer calls reach it (NCCL needs GPUs): what was called, in order."""

    def __init__(self):
        self.calls: list[str] = []
        config = types.SimpleNamespace(hf_text_config=types.SimpleNamespace(tie_word_embeddings=True))
        self.llm_engine = types.SimpleNamespace(model_config=config)

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append(name)


def test_an_nccl_group_is_opened_again_for_a_new_learner_and_after_another_engines(tiny_model_path, tmp_path):
    """The NCCL group is rank 0's and one engine's. A kept engine whose learner was replaced (a failed update's
    retry) joins the new learner's group, and an engine whose learner opened a group with another engine since
    (an eval engine beside the rollout's) joins a new one; else the new rank 0 broadcast on no group, or on the
    other engine's. A group's first send is whole: the engine's weights did not come from it."""
    from conftest import learner_settings
    from refiner_core.learners.deepspeed_learner import DeepSpeedLearner
    from refiner_core.rollout.vllm_engine import VLLMRolloutEngine

    def learner():
        made = DeepSpeedLearner(tiny_model_path, None, 0, learner_settings(), None)  # ranks start on first job
        made.jobs = []

        def call(kind, samples=None, serve=None, meanwhile=None, **payload):  # the ranks' side needs CUDA
            made.jobs.append((kind, payload.get("delta")))
            if meanwhile is not None:
                meanwhile()

        made._call = call
        return made

    rollout, evaluation = (
        VLLMRolloutEngine(_TransferCalls(), None, transport="delta", dtype=torch.bfloat16) for _ in range(2)
    )
    first = learner()
    first.send_weights(rollout, holding=None, sending="w1")
    first.send_weights(rollout, holding="w1", sending="w2")
    assert first.jobs == [("transfer_init", None), ("send_weights", False), ("send_weights", True)]
    assert rollout.transfer_group and rollout.llm.calls.count("init_weight_transfer_engine") == 1

    first.send_weights(evaluation, holding=None, sending="w2")  # rank 0's group is now the eval engine's
    first.send_weights(rollout, holding="w2", sending="w3")
    assert first.jobs[3:] == [("transfer_init", None), ("send_weights", False)] * 2
    assert rollout.transfer_group != evaluation.transfer_group

    first.close()
    second = learner()  # the retry's learner: new ranks, and the engine is kept
    second.send_weights(rollout, holding="w3", sending="w4")
    assert second.jobs == [("transfer_init", None), ("send_weights", False)]
    second.close()
