import torch

from config.model import ModelConfig
from engines.inference.embedded.generate import generate
from engines.inference.embedded.sampling import _mix, sample, uniform
from engines.models.decoder import CausalLM
from engines.models.tokenizer import CharTokenizer
from engines.seeds import derive_seed, row_seeds, splitmix64

TOK = CharTokenizer()


def test_tensor_hash_matches_the_reference_splitmix64():
    xs = [0, 1, 42, 2**40 + 7, 2**62 - 1]
    got = _mix(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert [g & (2**64 - 1) for g in got] == [splitmix64(x) for x in xs]


def test_uniform_is_in_range_and_differs_by_seed_and_position():
    seeds = torch.tensor([1, 2], dtype=torch.int64)
    u = uniform(seeds, 0, 1000)
    assert u.shape == (2, 1000) and float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.03
    assert not torch.equal(u[0], u[1])
    assert not torch.equal(u, uniform(seeds, 1, 1000))
    assert torch.equal(u, uniform(seeds, 0, 1000))


def test_gumbel_max_draws_from_the_categorical_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20000
    logp = probs.log().expand(n, 4)
    seeds = torch.tensor([derive_seed(7, i) for i in range(n)], dtype=torch.int64)
    freq = torch.bincount(sample(logp, seeds, 0), minlength=4).double() / n
    assert torch.allclose(freq, probs.double(), atol=0.015)


def test_row_seeds_are_distinct_and_stable():
    a = row_seeds(123, 8)
    assert len(set(a)) == 8 and a == row_seeds(123, 8) and a != row_seeds(124, 8)
    assert all(0 <= s < 2**63 for s in a)


def test_a_row_samples_the_same_tokens_alone_or_in_any_batch():
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64),
                     TOK.vocab_size).eval()  # fmt: skip
    target = TOK.encode("rev:abcd=")

    def run(prompts, seeds):
        return generate(model, prompts, max_new_tokens=[10] * len(prompts), temperatures=[1.0] * len(prompts),
                        eos_id=TOK.eos_id, pad_id=TOK.pad_id, seeds=seeds)  # fmt: skip

    alone = run([target], [99])[0]
    crowded = run([TOK.encode("sort:zyxwvutsr="), target, TOK.encode("x=")], [5, 99, 6])[1]
    assert alone.token_ids == crowded.token_ids
    torch.testing.assert_close(torch.tensor(alone.logprobs), torch.tensor(crowded.logprobs), rtol=0, atol=1e-5)


def test_chunked_in_place_sampling_draws_the_reference_tokens():
    """`sample` (rows in L2-sized chunks, in-place scratch buffers) equals the plain whole-batch definition bit for bit,
    over several chunks, per-row positions, truncated (-inf) entries and a vocabulary that is not a power of two."""
    from engines.inference.embedded.sampling import CHUNK_BYTES, sample_reference

    vocab = 49152 + 7
    rows = 3 * max(1, CHUNK_BYTES // (16 * vocab)) + 1  # three full chunks and a partial one
    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(rows, vocab, generator=g) * 3, dim=-1)
    logp[0, 100:] = float("-inf")  # a truncated row
    seeds = torch.randint(0, 2**62, (rows,), generator=g)
    for position in (0, 5, torch.arange(rows) * 3):
        assert torch.equal(sample(logp, seeds, position), sample_reference(logp, seeds, position))
