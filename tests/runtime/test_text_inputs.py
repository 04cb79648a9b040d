"""Prompt → text encoder inputs with textual-inversion embeddings, against diffusers'
`load_textual_inversion` on the tiny model: the same ids and the same looked-up embeddings
(exactly), the same hidden states through the exported module's entry in torch; and the
artifact-facing parts (declared inputs, old id-taking artifacts, bad combinations)."""

from __future__ import annotations

import numpy as np
import pytest

from sdiree.runtime.embeddings import load_embedding
from sdiree.runtime.errors import UserError
from sdiree.runtime.manifest import FunctionDecl, TensorDecl
from sdiree.runtime.text_inputs import TextInputs
from sdiree.runtime.tokenizer import ClipTokenizer

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

WIDTH = 32  # the tiny model's text encoder


def vectors(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, WIDTH, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("emb")
    one, three = d / "my-cat.safetensors", d / "learned_embeds.safetensors"
    safetensors_torch.save_file({"emb_params": vectors(1, 1)}, one)
    safetensors_torch.save_file({"<style-x>": vectors(3, 2)}, three)
    return one, three


@pytest.fixture(scope="module")
def reference(tiny_model, files):
    """diffusers' pipeline with both embeddings loaded, and the table before loading."""
    import diffusers

    pipe = diffusers.StableDiffusionPipeline.from_pretrained(
        tiny_model, safety_checker=None, requires_safety_checker=False, local_files_only=True
    )
    table = pipe.text_encoder.get_input_embeddings().weight.detach().numpy().copy()
    one, three = files
    pipe.load_textual_inversion(str(one), token="<my-cat>")
    pipe.load_textual_inversion(str(three))  # its own token, <style-x>, 3 vectors
    return pipe, table


def ours(tiny_model, table, files, dtype=np.float32) -> TextInputs:
    one, three = files
    tokenizer = ClipTokenizer.from_dir(tiny_model / "tokenizer")
    embs = [load_embedding(one, "<my-cat>"), load_embedding(three)]
    return TextInputs(tokenizer, table.astype(dtype), embs)


PROMPTS = [
    "a photo of <my-cat> in the style of <style-x>",
    "<STYLE-X>, <my-cat><my-cat>",
    "a photo of a cat",  # no embedding: the table's own rows
    "<style-x> " * 30,  # truncated inside an expansion
]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_ids_embeddings_and_hidden_states_match_diffusers(tiny_model, files, reference, prompt):
    from sdiree.compile.exporters.text_encoder import TextEncoderEntry

    pipe, table = reference
    inputs = ours(tiny_model, table, files)
    enc = inputs.encode(prompt)
    converted = pipe.maybe_convert_prompt(prompt.lower(), pipe.tokenizer)
    want_ids = pipe.tokenizer(
        converted, padding="max_length", max_length=77, truncation=True, return_tensors="pt"
    ).input_ids
    assert enc.ids.tolist() == want_ids[0].tolist()
    with torch.no_grad():
        want_embeds = pipe.text_encoder.get_input_embeddings()(want_ids)[0].numpy()
        want_hidden = pipe.text_encoder(want_ids)[0][0].numpy()
    np.testing.assert_array_equal(enc.embeds, want_embeds)  # the lookup is exact
    assert enc.ids[enc.eos_index] == inputs.tokenizer.eos_id
    assert enc.eos_index == int(np.flatnonzero(enc.ids == inputs.tokenizer.eos_id)[0])

    # The exported module's entry on these inputs (the model as compiled, its own table).
    import transformers

    model = transformers.CLIPTextModel.from_pretrained(tiny_model / "text_encoder").eval()
    with torch.no_grad():
        hidden, _ = TextEncoderEntry(model)(
            torch.from_numpy(enc.embeds)[None], torch.tensor([enc.eos_index])
        )
    np.testing.assert_array_equal(hidden[0].numpy(), want_hidden)
    assert [e.name for e in enc.used] == [
        n for n in ("<my-cat>", "<style-x>") if n in prompt.lower()
    ]


def test_prompt_without_embeddings_is_the_table_lookup(tiny_model, reference):
    _, table = reference
    tokenizer = ClipTokenizer.from_dir(tiny_model / "tokenizer")
    inputs = TextInputs(tokenizer, table.astype(np.float16))
    enc = inputs.encode("a lighthouse at dusk")
    np.testing.assert_array_equal(enc.ids, tokenizer.encode("a lighthouse at dusk").ids)
    np.testing.assert_array_equal(enc.embeds, table.astype(np.float16)[enc.ids])
    assert enc.embeds.dtype == np.float16 and enc.used == ()


def test_fp16_table_casts_the_vectors_as_diffusers(tiny_model, files, reference):
    _, table = reference
    inputs = ours(tiny_model, table, files, dtype=np.float16)
    enc = inputs.encode("<my-cat>")
    want = vectors(1, 1).half().numpy()[0]
    np.testing.assert_array_equal(enc.embeds[1], want)


def decl(*inputs) -> FunctionDecl:
    return FunctionDecl("encode", tuple(TensorDecl(*t) for t in inputs), ())


def test_arguments_follow_the_declaration(tiny_model, files, reference):
    _, table = reference
    inputs = ours(tiny_model, table, files)
    enc = inputs.encode("<my-cat> on a hill")
    embeds, eos = inputs.arguments(
        enc, decl(("inputs_embeds", (2, 77, WIDTH), "float32"), ("eos_index", (2,), "int64"))
    )
    assert embeds.shape == (2, 77, WIDTH) and embeds.flags.c_contiguous
    np.testing.assert_array_equal(embeds[1], enc.embeds)
    assert eos.dtype == np.int64 and eos.tolist() == [enc.eos_index] * 2
    (ids,) = inputs.arguments(enc, decl(("input_ids", (1, 77), "int64")))  # an older artifact
    np.testing.assert_array_equal(ids[0], enc.ids)
    with pytest.raises(UserError, match="'attention_mask' this sdiree does not know"):
        inputs.arguments(enc, decl(("attention_mask", (1, 77), "int64")))
    with pytest.raises(UserError, match="shape"):
        inputs.arguments(enc, decl(("inputs_embeds", (1, 77, 16), "float32")))


def test_bad_combinations_are_one_line(tiny_model, files, reference, tmp_path):
    _, table = reference
    one, three = files
    tokenizer = ClipTokenizer.from_dir(tiny_model / "tokenizer")
    with pytest.raises(UserError, match="takes token ids only; recompile"):
        TextInputs(tokenizer, None, [load_embedding(one)])
    wide = tmp_path / "wide.safetensors"
    safetensors_torch.save_file({"emb_params": torch.zeros(2, 48)}, wide)
    with pytest.raises(UserError, match="width 48; this model's text encoder takes 32"):
        TextInputs(tokenizer, table, [load_embedding(wide)])
    with pytest.raises(UserError, match="both answer to"):
        TextInputs(tokenizer, table, [load_embedding(one, "<x>"), load_embedding(three, "<X>")])
    with pytest.raises(UserError, match="already a token"):
        TextInputs(tokenizer, table, [load_embedding(one, "a</w>")])
    with pytest.raises(UserError, match="already a token"):
        TextInputs(tokenizer, table, [load_embedding(one, "<|endoftext|>")])
    assert TextInputs(tokenizer, None).encode("a cat").embeds is None  # ids-only, no embedding


def test_default_words_call_the_embedding(tiny_model, files, reference):
    _, table = reference
    one, _ = files
    tokenizer = ClipTokenizer.from_dir(tiny_model / "tokenizer")
    inputs = TextInputs(tokenizer, table, [load_embedding(one)])  # my-cat, <my-cat>
    new = tokenizer.vocab_size
    for prompt, calls in (
        ("a photo of my-cat", 1),
        ("a photo of <My-Cat>", 1),
        ("my-cat, (my-cat:1.2) <my-cat>", 3),
        ("my-cats and xmy-cat", 0),
    ):
        enc = inputs.encode(prompt)
        assert int((enc.ids == new).sum()) == calls, prompt
    assert inputs.encode("<my-cat>").ids[1:3].tolist() == [new, tokenizer.eos_id]  # no < >


def test_diffusers_files_answer_to_their_own_tokens(tiny_model, reference, tmp_path):
    """sd-concepts-library files are all called learned_embeds: their names do not clash."""
    _, table = reference
    paths = []
    for token in ("<a>", "<b>"):
        path = tmp_path / token[1] / "learned_embeds.safetensors"
        path.parent.mkdir()
        safetensors_torch.save_file({token: vectors(1, ord(token[1]))}, path)
        paths.append(path)
    tokenizer = ClipTokenizer.from_dir(tiny_model / "tokenizer")
    inputs = TextInputs(tokenizer, table, [load_embedding(p) for p in paths])
    enc = inputs.encode("<b> then <a>, learned_embeds")
    assert [e.name for e in enc.used] == ["<a>", "<b>"]
    v = tokenizer.vocab_size
    assert enc.ids[1] == v + 1 and list(enc.ids).count(v) == 1
