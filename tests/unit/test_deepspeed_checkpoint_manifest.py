"""The manifest of a DeepSpeed checkpoint folder (megatron/integrations/deepspeed/), in one
process: it lists every file under the folder, and verification names a damaged, short or
missing file; --no-verify-checkpoint (checksums off) still catches a wrong size; a folder
without a manifest (DeepSpeed's own) passes with a warning."""

from __future__ import annotations

import logging

import pytest

from megatron.checkpointing.errors import CheckpointCorruptError
from megatron.checkpointing.folder import folder_digests
from megatron.checkpointing.manifest import build_manifest, write_manifest
from megatron.integrations.deepspeed.engine import _verify_deepspeed_folder

FILES = {"mp_rank_00_model_states.pt": b"weights" * 50,
         "zero_pp_rank_1_mp_rank_00_optim_states.pt": b"moments" * 70,
         "layer_01/nested.bin": b"\x00\x01" * 9}


@pytest.fixture()
def folder(tmp_path):
    for rel, data in FILES.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    write_manifest(str(tmp_path), build_manifest(3, {}, None, folder_digests(str(tmp_path))))
    return tmp_path


def test_manifest_lists_every_file_and_verifies(folder):
    digests = folder_digests(str(folder))
    assert {rel: d.size for rel, d in digests.items()} == {
        rel: len(data) for rel, data in FILES.items()}  # the manifest itself is not listed
    _verify_deepspeed_folder(str(folder), checksums=True)


def test_flipped_byte_truncation_and_missing_file_are_named(folder):
    target = folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = bytearray(FILES[target.name])
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    _verify_deepspeed_folder(str(folder), checksums=False)  # same size: sizes only pass
    with pytest.raises(CheckpointCorruptError, match=rf"{target.name} is damaged: its CRC-32"):
        _verify_deepspeed_folder(str(folder), checksums=True)
    target.write_bytes(bytes(data[:-1]))
    with pytest.raises(CheckpointCorruptError, match=r"truncated"):
        _verify_deepspeed_folder(str(folder), checksums=False)
    (folder / "layer_01" / "nested.bin").unlink()
    target.write_bytes(FILES[target.name])
    with pytest.raises(CheckpointCorruptError, match=r"layer_01/nested.bin does not exist"):
        _verify_deepspeed_folder(str(folder), checksums=True)


def test_folder_without_manifest_loads_with_a_warning(folder, caplog):
    (folder / "manifest.json").unlink()
    (folder / "mp_rank_00_model_states.pt").write_bytes(b"anything")
    with caplog.at_level(logging.WARNING):
        _verify_deepspeed_folder(str(folder), checksums=True)
    assert "has no manifest.json" in caplog.text and str(folder) in caplog.text
