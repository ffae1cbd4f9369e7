"""A LoRA adapter's source is fetched by every worker, with the worker's environment
(database URL, secret key, storage keys): it names a pinned wheel or a folder, never
something pip would build (a direct URL, a local path, a requirements file, pip options);
its name is its folder's name and never leaves the adapters folder; only superusers
register adapters."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from django.urls import reverse

from engine.prepare import adapter_source_problem, pinned_requirement, prepare_adapter
from jobs.lib.model_registry import adapter_problem
from jobs.models import LoraAdapter
from tests.lora import build_wheel, write_adapter_config


def evil_source_tree(folder: Path, marker: Path) -> Path:
    """A source tree whose build backend writes `marker` when pip asks it anything: what
    `pip download` of a direct URL runs, --only-binary or not."""
    folder.mkdir(parents=True)
    (folder / "pyproject.toml").write_text(
        '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n')
    (folder / "backend.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n")
    return folder


@pytest.mark.parametrize("text", [
    "evil @ https://example.com/evil-1.tar.gz",
    "evil@https://example.com/evil-1.tar.gz",
    "/some/dir",
    "./dir",
    "-r requirements.txt",
    "-rrequirements.txt",
    "--no-binary=:all: evil==1",
    "evil==1 --index-url=https://example.com/simple",
    "evil==1 -r requirements.txt",
    "evil==1 --hash=md5:0123",
    "evil>=1",
    "evil==1.*",
    "evil",
    "evil[extra]==1",
    'evil==1; python_version > "3"',
    "evil==1,==2",
    "",
])
def test_an_adapter_source_names_a_pinned_wheel_only(text):
    problem = adapter_source_problem(f"pypi:{text}")
    assert problem is not None and "pinned wheel" in problem
    with pytest.raises(ValueError, match="pinned wheel"):
        pinned_requirement(text)


def test_a_pinned_source_and_its_hashes_are_read():
    assert pinned_requirement("Some.Lora==1.2") == ("Some.Lora==1.2", [])
    assert pinned_requirement(" x==1.0  --hash=sha256:ab01 --hash=sha512:cd ") == (
        "x==1.0", [("sha256", "ab01"), ("sha512", "cd")])


def test_a_direct_url_source_runs_nothing_on_the_worker(tmp_path):
    marker = tmp_path / "ran"
    tree = evil_source_tree(tmp_path / "evil", marker)
    for source in (f"pypi:evil @ {tree.as_uri()}", f"pypi:{tree}"):
        with pytest.raises(ValueError, match="pinned wheel"):
            prepare_adapter("evil", source, tmp_path / "models")
    assert not marker.exists()


@pytest.mark.processes
def test_a_wheel_must_match_the_sources_hash(tmp_path, monkeypatch):
    folder = write_adapter_config(tmp_path / "src")
    wheel = build_wheel(folder, tmp_path / "wheels", name="batchweb-hashed-lora", version="2.0")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "wheels"))
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    with pytest.raises(ValueError, match="matches none"):
        prepare_adapter("hashed", f"pypi:batchweb-hashed-lora==2.0 --hash=sha256:{'0' * 64}",
                        tmp_path / "models")
    assert not (tmp_path / "models" / "adapters" / "hashed").exists()
    path = prepare_adapter("hashed", f"pypi:batchweb-hashed-lora==2.0 --hash=sha256:{digest}",
                           tmp_path / "models")
    assert (path / "adapter_config.json").is_file()


@pytest.mark.parametrize("name", [".", "..", "a/b", "../up", "-x", "_x", "a b", "", "a\\b"])
def test_an_adapter_name_is_its_own_folder(name, tmp_path):
    with pytest.raises(ValueError, match="letters, digits"):
        prepare_adapter(name, "pypi:x==1", tmp_path / "models")
    assert not (tmp_path / "models").exists()


@pytest.mark.django_db
@pytest.mark.parametrize("name", [".", "..", "a/b", "a_b/", "x y"])
def test_the_registry_refuses_names_that_are_no_folder(name):
    problem = adapter_problem(name=name, base_model="echo-test", source="/adapters/x")
    assert problem is not None and problem[0] == "name"
    # Two names that used to share one folder are both fine or refused, never one folder.
    assert adapter_problem(name="a_b", base_model="echo-test", source="/adapters/x") is None


@pytest.mark.django_db
def test_only_superusers_add_or_change_adapters(client, admin_client, django_user_model,
                                                tmp_path):
    from django.contrib.auth.models import Permission

    staff = django_user_model.objects.create_user("staff", password="pw-staff-123",
                                                  is_staff=True)
    staff.user_permissions.set(Permission.objects.filter(
        content_type__app_label="jobs", content_type__model="loraadapter"))
    client.force_login(staff)
    add = reverse("admin:jobs_loraadapter_add")
    source = str(write_adapter_config(tmp_path / "a"))
    assert client.get(add).status_code == 403
    assert client.post(add, {"name": "tuned", "base_model": "echo-test",
                             "source": source}).status_code == 403
    assert not LoraAdapter.objects.exists()

    adapter = LoraAdapter.objects.create(name="tuned", base_model="echo-test", source=source)
    change = reverse("admin:jobs_loraadapter_change", args=[adapter.pk])
    assert client.post(change, {}).status_code == 403
    # A superuser adds and changes them, told the rules.
    page = admin_client.get(add)
    assert page.status_code == 200 and b"pypi:NAME==VERSION" in page.content
    assert admin_client.get(change).status_code == 200
