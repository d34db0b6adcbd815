"""On-policy distillation (docs/distillation.md): the embedded engine's prompt-logprob scoring against the trainer's
logprobs, the advantage mix, the per-token advantage path of the trainer's batches, the lake columns, and the
refusals (another tokenizer, a config with no signal)."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pyarrow as pa
import pytest
import torch

from config.model import ModelConfig
from config.run import RunConfig
from config.teacher import TeacherConfig
from config.trainer import TrainerConfig
from engines import protocol as api
from engines.inference.backend import Generation
from engines.inference.embedded.engine import Engine
from engines.inference.embedded.serving import Serving
from engines.models import modeldir
from engines.models.decoder import CausalLM, token_logprobs
from engines.models.tokenizer import CharTokenizer
from engines.orchestrator import teacher
from engines.trainer.batch import make_batch, pack_batch
from engines.trainer.common import batch_logprobs, packed_logprobs
from engines.trainer.losses.objective import Objective, StepCounts, token_scores
from engines.trainer.rl import zero_advantage_samples
from storage import rollouts
from storage.rollouts import RolloutRow

TOK = CharTokenizer()
CFG = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96)


def _model(seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    model = CausalLM(CFG, TOK.vocab_size)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)  # peaked distributions: logprobs far from uniform
    return model.eval()


async def _score(serving: Serving, prompt: list[int], k: int, n: int = 1) -> list[api.CompletionChoice]:
    body = api.CompletionRequest(prompt=prompt, max_tokens=1, temperature=0.0, prompt_logprobs=k, n=n)
    p = serving.prepare(Generation(body))
    return serving.completion(p, await serving.run(p)).choices


def test_prompt_logprobs_equal_the_trainers_logprobs():
    """The engine scores prompts of different lengths (left-padded in one prefill, shared by n samples) as the
    trainer's right-padded forward does: measured max |diff| 4.8e-7 (fp32 on this CPU)."""
    import asyncio

    model = _model()
    engine = Engine(model, 0, TOK.eos_id, TOK.pad_id, max_batch_size=16, seed=0)
    serving = Serving(engine, TOK, "m")
    prompts = [TOK.encode("rev:abcdefgh=hgfedc"), TOK.encode("srt:zy=yz"), TOK.encode("rev:q=")]

    async def all_prompts():
        return await asyncio.gather(*(_score(serving, p, 2, n=2) for p in prompts))

    try:
        results = asyncio.run(all_prompts())
    finally:
        engine.stop()
    width = max(map(len, prompts))
    ids = torch.tensor([p + [TOK.pad_id] * (width - len(p)) for p in prompts])
    with torch.no_grad():
        logits = model(ids)[:, :-1]
        want = token_logprobs(logits, ids[:, 1:], 1.0)
        want_all = torch.log_softmax(logits.float(), dim=-1)
    worst = 0.0
    for i, (p, choices) in enumerate(zip(prompts, results, strict=True)):
        for choice in choices:
            entries = choice.prompt_logprobs
            assert entries is not None and entries[0] is None and len(entries) == len(p)
            got = torch.tensor(teacher.completion_scores(entries, p, 1))
            worst = max(worst, float((got - want[i, : len(p) - 1]).abs().max()))
            for pos, entry in enumerate(entries[1:], start=1):  # the token, and the 2 most likely (ranks 1, 2)
                assert entry is not None and 2 <= len(entry) <= 3
                assert {1, 2} <= {e.rank for e in entry.values()}
                assert entry[str(p[pos])].rank == 1 + int((want_all[i, pos - 1] > want[i, pos - 1]).sum())
    print(f"prompt_logprobs vs trainer: max |diff| {worst:.1e}")
    assert worst < 2e-6


def test_prompt_logprobs_are_refused_when_streaming():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        api.CompletionRequest(prompt=[1, 2], prompt_logprobs=0, stream=True)


def _row(k: int, completion: list[int], sampler: list[float], advantage: float, mask=None) -> RolloutRow:
    return RolloutRow(
        run_id="r", step=1, sample_id=f"s000001-g0000-{k:02d}", group_id="s000001-g0000", env="reverse-text",
        policy_version=0, policy_version_end=0, prompt_ids=[1, 20, 21, 5], completion_ids=completion,
        completion_logprobs=sampler, reward=0.5, advantage=advantage, temperature=1.0, finish_reason="stop",
        prompt_text="rev:ab=", completion_text="ba", completion_mask=mask,
        turn_policy_versions=None if mask is None else [0], turn_policy_versions_end=None if mask is None else [0],
    )  # fmt: skip


def test_the_advantage_mix():
    a = _row(0, [22, 23, 2], [-0.5, -1.0, -0.25], 0.75)
    b = _row(1, [22, 9, 23], [-0.5, -0.1, -2.0], -0.5, mask=[1, 0, 1])  # a multi-turn row: token 1 is the env's
    a.teacher_logprobs, b.teacher_logprobs = [-0.25, -3.0, -0.25], [-1.5, -9.0, -1.0]
    teacher.mix([a, b], TeacherConfig(path="t", kl_coef=2.0, reward_coef=0.5))
    assert a.token_advantages == [2.0 * 0.25 + 0.375, 2.0 * -2.0 + 0.375, 0.375]
    assert b.token_advantages == [2.0 * -1.0 - 0.25, 0.0, 2.0 * 1.0 - 0.25]
    # the reverse-KL estimate over model tokens: (0.25 + 2.0 + 0 + 1.0 - 1.0) / 5
    assert teacher.teacher_kl([a, b]) == pytest.approx((-0.25 + 2.0 + 0.0 + 1.0 - 1.0) / 5)
    table = rollouts.to_table([a, b])
    assert rollouts.teacher_kl(table) == {"teacher_kl": pytest.approx(0.35)}
    c = _row(2, [22], [-0.5], 1.0)  # pure distillation: the environment advantage does not count
    c.teacher_logprobs = [-0.5]
    teacher.mix([c], TeacherConfig(path="t"))
    assert c.token_advantages == [0.0]


def test_centering_subtracts_the_steps_mean_gap_from_every_model_token():
    a = _row(0, [22, 23, 2], [-0.5, -1.0, -0.25], 0.75)
    b = _row(1, [22, 9, 23], [-0.5, -0.1, -2.0], -0.5, mask=[1, 0, 1])
    a.teacher_logprobs, b.teacher_logprobs = [-0.25, -3.0, -0.25], [-1.5, -9.0, -1.0]
    cfg = TeacherConfig(path="t", kl_coef=2.0, reward_coef=0.0, center=True)
    kl = teacher.Teacher.set_advantages(SimpleNamespace(cfg=cfg), [a, b])  # type: ignore[arg-type]
    assert kl == pytest.approx(0.35)
    gaps = [0.25, -2.0, 0.0, -1.0, 1.0]  # teacher - sampler on the five model tokens; their mean is -0.35
    centered = [2.0 * (g + 0.35) for g in gaps]
    model = [
        a.token_advantages[0],
        a.token_advantages[1],
        a.token_advantages[2],
        b.token_advantages[0],
        b.token_advantages[2],
    ]
    assert model == pytest.approx(centered, abs=1e-12) and sum(model) == pytest.approx(0.0, abs=1e-12)
    assert b.token_advantages[1] == 0.0  # the environment's token stays out


def test_lake_columns_check_lengths_and_older_shards_read_without_them():
    row = _row(0, [22, 23], [-0.5, -1.0], 0.75)
    row.teacher_logprobs = [-0.5]
    with pytest.raises(ValueError, match="teacher_logprobs has 1 entries for 2 completion tokens"):
        rollouts.to_table([row])
    older = rollouts.to_table([_row(0, [22, 23], [-0.5, -1.0], 0.75)]).drop(["teacher_logprobs", "token_advantages"])
    batch = make_batch(older, TOK.pad_id)
    assert batch.advantages.shape == (1,) and rollouts.teacher_kl(older) == {}
    assert rollouts.SCHEMA_VERSION >= 4


def _steps_table(per_token: bool, seed: int = 0, n: int = 10) -> pa.Table:
    """Rows of varied lengths; with `per_token`, half carry `token_advantages` equal to their scalar broadcast."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for k in range(n):
        c_len = 1 + int(torch.randint(0, 12, (1,), generator=g))
        completion = torch.randint(4, TOK.vocab_size, (c_len,), generator=g).tolist()
        sampler = (-torch.rand(c_len, generator=g) * 3).tolist()
        adv = float(torch.randn(1, generator=g))
        row = _row(k, completion, sampler, adv)
        row.group_id = f"s000001-g{k // 2:04d}"
        rows.append(row)
    table = rollouts.to_table(rows)
    if not per_token:
        return table
    adv = table.column("advantage").to_pylist()  # float32 already: the broadcast is exact
    completions = table.column("completion_ids").to_pylist()
    tokens = [[a] * len(c) if k % 2 else None for k, (a, c) in enumerate(zip(adv, completions, strict=True))]
    return table.set_column(
        table.column_names.index("token_advantages"), "token_advantages", pa.array(tokens, pa.list_(pa.float32()))
    )


@pytest.mark.parametrize("packed", [False, True])
def test_token_advantages_equal_to_the_scalar_give_the_same_loss_and_gradients(packed):
    objective = Objective(TrainerConfig())
    results = []
    for per_token in (False, True):
        batch = make_batch(_steps_table(per_token), TOK.pad_id)
        assert batch.advantages.dim() == (2 if per_token else 1)
        model = _model(1)
        model.train()
        if packed:
            mb = pack_batch(batch, TOK.pad_id)
            logprobs = packed_logprobs(model, mb)
        else:
            mb = batch
            logprobs = batch_logprobs(model, mb)
        counts = StepCounts(float(mb.loss_mask.sum()), float(len(batch)))
        loss, _ = objective(token_scores(mb, logprobs), counts)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (loss_s, grads_s), (loss_t, grads_t) = results
    assert torch.equal(loss_s, loss_t)
    assert max(float((a - b).abs().max()) for a, b in zip(grads_s, grads_t, strict=True)) == 0.0


def test_per_token_advantages_count_against_zero_advantage_filtering():
    rows = [_row(k, [22, 23], [-0.5, -1.0], 0.0) for k in range(2)]  # a group with equal rewards: scalar 0
    assert zero_advantage_samples(rollouts.to_table(rows)).all()
    rows[0].teacher_logprobs, rows[1].teacher_logprobs = [-0.5, -0.5], [-0.5, -1.0]
    teacher.mix(rows, TeacherConfig(path="t"))
    assert rows[1].token_advantages == [0.0, 0.0] and rows[0].token_advantages == [0.0, 0.5]
    assert not zero_advantage_samples(rollouts.to_table(rows)).any()  # the group carries a gradient


def _model_dir(tmp_path, name: str):
    """A model directory of the built-in tiny model, as a publication writes it (char tokenizer files)."""
    source = modeldir.resolve(CFG)
    d = tmp_path / name
    d.mkdir()
    for file, data in modeldir.publication_files(source, TOK, TOK.vocab_size).items():
        (d / file).write_bytes(data)
    (d / "model.safetensors").write_bytes(b"")  # only the tokenizer is read here
    return d


def test_a_teacher_with_another_tokenizer_is_refused(tmp_path):
    from rollflow.checks import ConfigError, check_teacher

    same = _model_dir(tmp_path, "same")
    modeldir.check_same_tokenizer(ModelConfig(), ModelConfig(path=str(same)))  # the built-in tokenizer's files
    other = tmp_path / "other"
    shutil.copytree(same, other)
    data = json.loads((other / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # same size, two ids swapped
    (other / "tokenizer.json").write_text(json.dumps(data))
    cfg = RunConfig(teacher=TeacherConfig(path=str(other)))
    with pytest.raises(ConfigError, match=r"teacher.path=.*not the student's .*2 differ \(e.g. \['a', 'b'\]\)"):
        check_teacher(cfg)
    special = tmp_path / "special"
    shutil.copytree(same, special)
    config = json.loads((special / "tokenizer_config.json").read_text())
    (special / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<unk>"}))
    with pytest.raises(modeldir.ModelDirError, match=r"special tokens \(bos, eos, pad\)"):
        modeldir.check_same_tokenizer(ModelConfig(), ModelConfig(path=str(special)))


def test_teacher_config_is_validated():
    with pytest.raises(ValueError, match="kl_coef = 0 and teacher.reward_coef = 0"):
        TeacherConfig(path="t", kl_coef=0.0)
    with pytest.raises(ValueError, match="teacher.inference.port=8000 is inference.port too"):
        RunConfig(inference={"port": 8000}, teacher={"path": "t", "inference": {"port": 8000}})
    assert not RunConfig().teacher.enabled


def test_the_vllm_backend_forwards_prompt_logprobs_and_vllms_answer_reads():
    """What the vLLM backend sends upstream keeps `prompt_logprobs`, and vLLM's answer (its `Logprob` entries
    keyed by token id, serialised as text; the sampled token and the top k) gives the completion's scores."""
    import asyncio

    from engines.inference.vllm.backend import Upstream, VLLMBackend

    up = Upstream(["http://r0"], [], 0)
    up.open_gate.set()
    backend = VLLMBackend(up, None, None, "m", 64)  # type: ignore[arg-type]
    body = api.CompletionRequest(prompt=[1, 5, 6, 7], max_tokens=1, temperature=0.0, prompt_logprobs=0)
    url, sent, _, _ = asyncio.run(backend._start(Generation(body)))
    assert url == "http://r0/v1/completions" and sent["prompt_logprobs"] == 0 and sent["prompt"] == [1, 5, 6, 7]
    entries = [
        None,
        {"5": {"logprob": -1.5, "rank": 3, "decoded_token": "b"}, "9": {"logprob": -0.2, "rank": 1}},
        {"6": {"logprob": -0.25, "rank": 1, "decoded_token": "c"}},
        {"7": {"logprob": -4.0, "rank": 12, "decoded_token": "d"}, "8": {"logprob": -0.1, "rank": 1}},
    ]
    choice = {"index": 0, "text": "x", "finish_reason": "length", "prompt_logprobs": entries,
              "policy_version": 0, "policy_version_end": 0}  # fmt: skip
    usage = {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}
    response = api.CompletionResponse(id="c", created=0, model="m", choices=[choice], usage=usage)  # type: ignore[list-item]
    parsed = response.choices[0].prompt_logprobs or []
    assert teacher.completion_scores(parsed, [1, 5, 6, 7], 2) == [-0.25, -4.0]
    with pytest.raises(RuntimeError, match="lack token 7 at position 3"):
        teacher.completion_scores([*parsed[:3], {"8": parsed[3]["8"]}], [1, 5, 6, 7], 2)  # type: ignore[index]
