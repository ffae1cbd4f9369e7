"""LoRA adapters through the worker pipeline (echo engine, which answers "echo+<adapter>:"
where its base model answers "echo:"): validation resolves an adapter to its base model and
refuses unknown ones and another model's; the worker prepares an adapter's folder (from a
path, or a wheel fetched with pip) and hands it to the engine; an adapter removed after
validation fails only its own lines; the admin registers adapters; /v1/models lists them."""

from __future__ import annotations

import pytest
from django.urls import reverse

from engine.prepare import prepare_adapter
from jobs.models import Batch, LoraAdapter, Shard
from jobs.tasks import validate_batch
from jobs.worker.adapters import Adapter, AdapterFolders
from tests.factories import chat_line, finalized, jsonl, new_batch, run_all_shards, upload
from tests.lora import build_wheel, write_adapter_config

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def adapter(tmp_path):
    return LoraAdapter.objects.create(
        name="echo-tuned", base_model="echo-test",
        source=str(write_adapter_config(tmp_path / "echo-tuned")))


def answers(out: list[dict]) -> dict[str, str]:
    return {r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"]
            for r in out}


def test_adapter_lines_run_with_it_beside_the_base_models(make_batch, make_pipeline,
                                                           adapter):
    lines = [chat_line("base", "hello there"), chat_line("tuned", "hello there",
                                                         model="echo-tuned"),
             chat_line("base-2", "again"), chat_line("tuned-2", "again", model="echo-tuned")]
    batch = make_batch(lines, shard_size=10)
    assert batch.model == "echo-test"  # the adapter's lines run on its base model
    run_all_shards(make_pipeline(enable_lora=True), batch)
    done, out, err = finalized(batch)
    assert err == [] and done.status == "completed"
    assert answers(out) == {"base": "echo: hello there", "tuned": "echo+echo-tuned: hello there",
                            "base-2": "echo: again", "tuned-2": "echo+echo-tuned: again"}
    tuned = next(r for r in out if r["custom_id"] == "tuned")
    assert tuned["response"]["body"]["model"] == "echo-tuned"


def test_the_json_retry_of_an_adapter_line_runs_with_the_adapter(make_batch, make_pipeline,
                                                                 adapter):
    batch = make_batch([chat_line("tuned", "not json", model="echo-tuned",
                                  response_format={"type": "json_object"})])
    run_all_shards(make_pipeline(enable_lora=True), batch)
    _, out, _ = finalized(batch)
    # The echo answer is no JSON: it ran once more.
    assert Shard.objects.get(batch=batch).json_retries == 1
    assert answers(out) == {"tuned": "echo+echo-tuned: not json"}


def test_an_adapter_removed_after_validation_fails_only_its_lines(make_batch, make_pipeline,
                                                                 adapter):
    lines = [chat_line("base", "hi"), chat_line("tuned", "hi", model="echo-tuned"),
             chat_line("tuned-2", "hi", model="echo-tuned")]
    batch = make_batch(lines, shard_size=10)
    adapter.delete()
    run_all_shards(make_pipeline(enable_lora=True), batch)
    done, out, err = finalized(batch)
    assert answers(out) == {"base": "echo: hi"}
    assert {r["custom_id"]: r["error"]["code"] for r in err} == {
        "tuned": "model_not_found", "tuned-2": "model_not_found"}
    assert "echo-tuned" in err[0]["error"]["message"]


def test_an_adapter_is_resolved_once_per_shard_not_per_line(make_batch, make_pipeline,
                                                            adapter, monkeypatch):
    # Two shards of three lines: each asks for the adapter once, registered or not.
    lines = [chat_line(f"tuned-{n}", f"hi {n}", model="echo-tuned") for n in range(5)]
    batch = make_batch([*lines, chat_line("base", "hi")], shard_size=3)
    pipeline = make_pipeline(enable_lora=True)
    adapters = pipeline.intake.served.adapters
    asked: list[str] = []

    def prepared(name: str, **kwargs: str) -> Adapter | None:
        asked.append(name)
        return AdapterFolders.prepared(adapters, name, **kwargs)

    monkeypatch.setattr(adapters, "prepared", prepared)
    run_all_shards(pipeline, batch)
    done, out, err = finalized(batch)
    assert err == [] and len(out) == 6
    assert asked == ["echo-tuned", "echo-tuned"]
    for shard in Shard.objects.filter(batch=batch):
        assert [a["name"] for a in shard.provenance["adapters"]] == ["echo-tuned"]


def test_validation_refuses_unknown_adapters_and_another_models(openai_client, settings,
                                                               adapter, tmp_path):
    settings.BATCHWEB_MODELS = [*settings.BATCHWEB_MODELS,
                                {**settings.ECHO_MODEL, "name": "echo-other"},
                                {**settings.ECHO_MODEL, "name": "echo-plain",
                                 "options": {"enable_lora": False}}]
    LoraAdapter.objects.create(name="other-tuned", base_model="echo-other",
                               source=str(write_adapter_config(tmp_path / "o")))
    LoraAdapter.objects.create(name="plain-tuned", base_model="echo-plain",
                               source=str(write_adapter_config(tmp_path / "p")))
    batch = new_batch(openai_client, upload(openai_client, jsonl([
        chat_line("a", "x"), chat_line("b", "x", model="echo-tuned"),
        chat_line("c", "x", model="no-such-adapter"),
        chat_line("d", "x", model="other-tuned"),
        # Its base model does not load adapters: as if it were not registered.
        chat_line("e", "x", model="plain-tuned")])).id)
    validate_batch(batch.id)
    batch = openai_client.batches.retrieve(batch.id)
    assert batch.status == "failed"
    errors = {e.line: (e.code, e.message) for e in batch.errors.data}
    assert set(errors) == {3, 4, 5}
    assert errors[3] == ("model_not_found", "The model 'no-such-adapter' is not served here.")
    assert errors[4][0] == "mismatched_model"
    assert "'other-tuned' is for the model 'echo-other'" in errors[4][1]
    assert errors[5][0] == "model_not_found"


def test_models_lists_adapters_with_their_base(openai_client, adapter):
    models = {m.id: m for m in openai_client.models.list()}
    assert "echo-test" in models
    assert models["echo-tuned"].model_extra["parent"] == "echo-test"


def test_an_adapter_from_a_wheel_is_fetched_with_pip_once(tmp_path, monkeypatch):
    folder = write_adapter_config(tmp_path / "src", rank=4)
    (folder / "adapter_model.safetensors").write_bytes(b"weights")
    wheels = tmp_path / "wheels"
    build_wheel(folder, wheels, name="batchweb-test-lora", version="1.2")
    # pip finds it in a local folder, as it would on an operator's index.
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    cache = tmp_path / "models"
    path = prepare_adapter("tuned-1", "pypi:batchweb-test-lora==1.2", cache)
    assert path == cache / "adapters" / "tuned-1"
    assert (path / "adapter_model.safetensors").read_bytes() == b"weights"
    assert (path / "adapter_config.json").read_text() == (folder / "adapter_config.json"
                                                          ).read_text()
    # Prepared once: a second call does not ask pip (the wheel is gone).
    for wheel in wheels.iterdir():
        wheel.unlink()
    assert prepare_adapter("tuned-1", "pypi:batchweb-test-lora==1.2", cache) == path


def test_an_adapter_path_must_hold_an_adapter(tmp_path):
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        prepare_adapter("x", str(tmp_path), tmp_path / "models")
    with pytest.raises(ValueError, match="absolute folder path"):
        prepare_adapter("x", "relative/folder", tmp_path / "models")


def test_the_admin_registers_adapters_and_refuses_bad_ones(admin_client, settings, tmp_path):
    settings.BATCHWEB_MODELS = [*settings.BATCHWEB_MODELS,
                                {**settings.ECHO_MODEL, "name": "echo-plain",
                                 "options": {"enable_lora": False}}]
    add = reverse("admin:jobs_loraadapter_add")
    page = admin_client.get(add)
    assert page.status_code == 200
    # Offered: only the models that load adapters.
    assert b'value="echo-test"' in page.content and b'value="echo-plain"' not in page.content

    refused = admin_client.post(add, {"name": "echo-test", "base_model": "echo-test",
                                      "source": "relative"})
    assert refused.status_code == 200
    assert b"is a served model&#x27;s name" in refused.content
    refused = admin_client.post(add, {"name": "x", "base_model": "echo-test",
                                      "source": "relative"})
    assert b"absolute folder path" in refused.content
    assert not LoraAdapter.objects.exists()

    source = str(write_adapter_config(tmp_path / "a"))
    done = admin_client.post(add, {"name": "tuned", "base_model": "echo-test",
                                   "source": source})
    assert done.status_code == 302
    adapter = LoraAdapter.objects.get()
    assert (adapter.name, adapter.base_model, adapter.source) == ("tuned", "echo-test", source)
    change = admin_client.get(reverse("admin:jobs_loraadapter_change", args=[adapter.pk]))
    assert change.status_code == 200 and b'name="source"' not in change.content
    assert Batch.objects.count() == 0
