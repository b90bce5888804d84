"""The cached tiny checkpoint is staged and renamed; an interrupted or damaged one is rebuilt with a message."""

from __future__ import annotations

import pytest

import servelab.models.tiny as tiny
from servelab.models.tiny_cache import COMPLETE_MARKER, cached_tiny_model, tiny_cache_problem


def test_an_interrupt_during_the_weight_write_leaves_no_folder(tmp_path, monkeypatch):
    real = tiny.save_weights

    def interrupted(weights, path, num_shards=1):
        real(weights, path, num_shards)
        next(iter(path.glob("*.safetensors"))).write_bytes(b"half")  # the write got this far
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny, "save_weights", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cached_tiny_model(tmp_path / "tiny")
    assert not (tmp_path / "tiny").exists(), "nothing that looks done is left behind"
    assert [p.name for p in tmp_path.iterdir()] == [], "the staging folder is removed too"
    monkeypatch.setattr(tiny, "save_weights", real)
    folder, message = cached_tiny_model(tmp_path / "tiny")
    assert message is None and tiny_cache_problem(folder) is None


@pytest.mark.parametrize("damage", ["config-only", "truncated", "deleted"])
def test_a_damaged_cache_is_detected_and_rebuilt_with_a_message(tmp_path, damage):
    folder, message = cached_tiny_model(tmp_path / "tiny")
    assert message is None and (folder / COMPLETE_MARKER).is_file()
    weights = folder / "model.safetensors"
    if damage == "config-only":  # what the old config-first writer left after an interrupt
        weights.unlink()
        (folder / COMPLETE_MARKER).unlink()
    elif damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:100])
    else:
        weights.unlink()
    assert tiny_cache_problem(folder) is not None
    again, message = cached_tiny_model(tmp_path / "tiny")
    assert again == folder and message is not None and "damaged" in message and "rebuilt" in message
    assert tiny_cache_problem(folder) is None
    from safetensors.torch import load_file

    assert load_file(str(weights)), "the rebuilt weights load"
    assert cached_tiny_model(tmp_path / "tiny") == (folder, None), "an intact cache is reused silently"


def test_a_file_in_the_cache_s_place_is_refused(tmp_path):
    (tmp_path / "tiny").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        cached_tiny_model(tmp_path / "tiny")


def test_the_demo_rebuilds_a_damaged_default_model_and_says_so(tmp_path, capsys):
    from servelab.cli import main

    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    (folder / "config.json").write_text("{}")  # config first, weights never written
    assert main(["demo", "--num-requests", "2", "--max-tokens", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "was damaged (no completion marker" in out and "rebuilt it" in out
    assert tiny_cache_problem(folder) is None


def test_an_incomplete_real_model_folder_is_rebuilt_with_a_message(tmp_path, capsys, monkeypatch):
    import servelab.models.hub as hub
    from servelab.cli.demo import resolve_demo_model

    half = tmp_path / "smollm2-135m-instruct"
    half.mkdir()
    (half / "config.json").write_text("{}")  # what an interrupted converter would leave, had it not been staged
    fetched = []
    monkeypatch.setitem(hub.REAL_MODELS, "smollm2",
                        (lambda: fetched.append(1) or half, lambda: half, lambda: (half / hub.DONE_MARKER).is_file()))
    path, _ = resolve_demo_model("smollm2", tmp_path)
    out = capsys.readouterr().out
    assert path == half and fetched == [1]
    assert "is incomplete or damaged (no completion marker); rebuilding it" in out


def test_a_converted_folder_damaged_after_its_build_is_rebuilt(tmp_path):
    import servelab.models.hub as hub

    builds = []

    def build(work):
        staged = work / "converted"
        staged.mkdir()
        (staged / "model.safetensors").write_bytes(b"x" * 1000)
        (staged / hub.DONE_MARKER).write_text("done\n")
        builds.append(1)
        return staged

    final = tmp_path / "real-model"
    assert hub._build_once(final, False, build) == final and hub.cache_problem(final) is None
    assert hub._build_once(final, False, build) == final and len(builds) == 1, "an intact folder is reused"
    (final / "model.safetensors").write_bytes(b"x" * 10)  # truncated after the build
    assert "model.safetensors has 10 bytes, 1000 were written" == hub.cache_problem(final)
    hub._build_once(final, False, build)
    assert len(builds) == 2 and hub.cache_problem(final) is None
    (final / hub.SIZES_FILE).unlink()  # a folder from before sizes were recorded: trusted on its marker
    assert hub.cache_problem(final) is None
