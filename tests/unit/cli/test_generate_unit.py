"""core.generate in this process: the context cropped to max_seq_len with padded ids never produced,
--eos-id refused without --tokenizer, and the tokenizer looked up through the data sections."""

from __future__ import annotations

import json

import pytest
import torch
from shared import generate_error_line as one_line_error

pytestmark = pytest.mark.usefixtures("one_thread")  # torch on one intra-op thread (conftest.one_thread)


class Recorder(torch.nn.Module):
    """forward(ids) -> logits that favour id 300 (past a 257-token vocabulary), then id (last + 1) % 256."""

    def __init__(self):
        super().__init__()
        self.lengths = []

    def forward(self, ids):
        self.lengths.append(ids.shape[1])
        logits = torch.zeros(ids.shape[0], ids.shape[1], 512)
        logits[..., 300] = 10.0
        logits[0, -1, (int(ids[0, -1]) + 1) % 256] = 5.0
        return logits


def test_context_cropped_to_max_seq_len_and_padded_ids_never_produced():
    from core.cli.generate import generate

    model = Recorder()
    out = generate(model, [1, 2, 3], 20, max_seq_len=8, vocab_limit=257)
    assert out == list(range(4, 24))
    assert model.lengths == [min(3 + i, 8) for i in range(20)]
    assert generate(Recorder(), [250], 20, max_seq_len=8, vocab_limit=257, eos_id=253) == [251, 252, 253]  # stops at EOS


def test_eos_id_without_tokenizer_is_refused(tmp_path, capsys):
    """--eos-id belongs to --tokenizer: alone it is refused in one line (not ignored for the recorded EOS)."""
    err = one_line_error(capsys, "--checkpoint", tmp_path / "missing", "--eos-id", 5)
    assert "--eos-id 5 is the EOS of --tokenizer, and no --tokenizer is given" in err
    # a seed torch's generator cannot take (it would raise ValueError: Overflow when unpacking long long)
    assert "--seed must be an integer from -2**63 to 2**64 - 1, got 18446744073709551616" in one_line_error(
        capsys, "--checkpoint", tmp_path / "missing", "--seed", 2**64
    )


def test_tokenizer_lookup_through_data_sections(tmp_path):
    """meta.json's tokenizer: relative paths from the data folder, the fingerprint checked, a
    text_stream's own key, mixture sources that must agree; tiktoken decodes."""
    import base64
    import hashlib

    from core.cli.text_codec import Codec, find_in_config
    from core.contract.errors import DataError

    ranks = tmp_path / "data" / "bytes.tiktoken"
    ranks.parent.mkdir()
    ranks.write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
    digest = hashlib.sha256(ranks.read_bytes()).hexdigest()
    meta = {"tokenizer": "tiktoken:bytes.tiktoken", "eos_id": 256, "tokenizer_fingerprint": digest}
    (tmp_path / "data" / "meta.json").write_text(json.dumps(meta))
    data = {"name": "token_bin", "path": str(tmp_path / "data")}
    record = find_in_config({"data": data}, "ckpt")
    assert record.spec == f"tiktoken:{ranks}" and record.eos_id == 256
    codec = Codec(record)
    assert codec.decode(codec.encode("Ye gods, it doth amaze me") + [256]) == "Ye gods, it doth amaze me"
    assert find_in_config({"data": {"name": "synthetic"}}, "ckpt") is None
    stream = {"name": "text_stream", "tokenizer": "bytes"}
    assert find_in_config({"data": stream}, "ckpt").spec == "bytes"
    mixed = {"name": "mixture", "sources": [data, stream]}
    with pytest.raises(DataError, match="different tokenizers"):
        find_in_config({"data": mixed}, "ckpt")
    assert find_in_config({"data": {"name": "mixture", "sources": [data, dict(data)]}}, "ckpt").spec == record.spec
    (tmp_path / "data" / "meta.json").write_text(json.dumps(dict(meta, tokenizer_fingerprint="0" * 64)))
    with pytest.raises(DataError, match="differs from the one the data was prepared with"):
        find_in_config({"data": data}, "ckpt")
