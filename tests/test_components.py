"""Many pipelines in one deployment: ``kvbatch.BatchInference`` in a dg project's ``defs.yaml``.

A temporary dg project (``[tool.dg]``, ``defs/<folder>/defs.yaml``) declaring two pipelines loads
with ``dagster.load_from_defs_folder``, each with its own assets under its own key prefix, its
own schedule, jobs and sensors; both are materialized for one date; a misspelt or invalid
attribute fails at load naming the file, the attribute and what was expected; the scaffolder
writes a ``defs.yaml`` that loads; a finished day's shard partitions are exactly its shards."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest
import yaml

from kvbatch.pipelines.factory import PipelineSpec, build_pipeline, default_spec
from kvbatch.pipelines.partitions import register_day_shards, shard_partitions_name
from tests.tiny_models import build_tiny_chat_model

DATE = "2026-11-29"
MAIN_ASSETS = ("prompts", "prompt_shards", "decode_results", "cost_rollup")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny"), max_positions=512)


def make_project(root: Path, pipelines: dict[str, str], monkeypatch) -> Path:
    """A dg project under ``root`` whose defs folder holds one ``<folder>/defs.yaml`` per entry;
    its module name is unique, so each test imports its own."""
    module = f"proj_{uuid.uuid4().hex[:8]}"
    root.mkdir(parents=True, exist_ok=True)
    (root / "pyproject.toml").write_text(
        f'[tool.dg]\ndirectory_type = "project"\n\n[tool.dg.project]\nroot_module = "{module}"\n'
        f'defs_module = "{module}.defs"\n')
    defs = root / module / "defs"
    defs.mkdir(parents=True)
    (root / module / "__init__.py").write_text("")
    (defs / "__init__.py").write_text("")
    for folder, text in pipelines.items():
        (defs / folder).mkdir()
        (defs / folder / "defs.yaml").write_text(text)
    monkeypatch.syspath_prepend(str(root))
    return root


def pipeline_yaml(name: str, model: str, extra: str = "") -> str:
    return (f"type: kvbatch.BatchInference\nattributes:\n  name: {name}\n  model: {model}\n"
            f"  input: /data/{name}/{{date}}.jsonl\n  schedule: \"30 3 * * *\"\n{extra}")


def _rows(n: int, tag: str) -> str:
    system = "You answer questions about a small bakery. Be brief and polite. " * 2
    return "".join(json.dumps({"custom_id": f"{tag}{i:02d}", "method": "POST", "url": "/v1/chat/completions", "body": {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"{tag} question {i}?"}],
        "max_tokens": 3, "temperature": 0}}) + "\n" for i in range(n))


def test_two_pipelines_load_each_with_its_own_assets_schedule_and_jobs(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBATCH_ROOT", str(tmp_path / "data"))
    project = make_project(tmp_path / "proj", {
        "tickets": pipeline_yaml("tickets", "smollm2-135m", "  shards: 5\n  owners: [\"team:support\"]\n"),
        "evals": pipeline_yaml("evals", "smollm2-135m", "  dtype: bf16\n  slo: {ttft_s_p95_max: 2.5}\n"),
    }, monkeypatch)
    defs = dg.load_from_defs_folder(path_within_project=project)
    dg.Definitions.validate_loadable(defs)
    keys = {k.to_user_string() for k in defs.resolve_asset_graph().get_all_asset_keys()}
    for name in ("tickets", "evals"):
        assert {f"{name}/{a}" for a in MAIN_ASSETS} <= keys
        sched = defs.resolve_schedule_def(f"{name}_nightly_ingest")
        assert sched.cron_schedule == "30 3 * * *"
        for job in ("ingest", "shard", "rollup"):
            defs.resolve_job_def(f"{name}_{job}")
        for sensor in ("shards_after_ingest", "rollup_after_shard", "rollup_after_failed_shard", "new_dataset_files"):
            defs.resolve_sensor_def(f"{name}_{sensor}")
    graph = defs.resolve_asset_graph()
    # Descriptions are Markdown the catalog previews raw: no reST double backticks or roles.
    for key in graph.get_all_asset_keys():
        text = graph.get(key).description or ""
        assert text and "``" not in text and ":func:" not in text, key
    assert graph.get(dg.AssetKey(["tickets", "prompts"])).owners == ["team:support"]
    assert graph.get(dg.AssetKey(["evals", "prompts"])).group_name == "evals"
    # Shared resources are one key; a pipeline's own are keyed by its name.
    assert {"object_store", "kv_store", "tickets_model", "evals_model", "evals_pricing"} <= set(defs.resources)
    assert defs.resources["evals_model"].dtype == "bf16" and defs.resources["tickets_model"].dtype == "fp32"
    # The schedule ingests the pipeline's own input for the day that just ended.
    ctx = dg.build_schedule_context(scheduled_execution_time=__import__("datetime").datetime(2026, 11, 30, 3, 30))
    req = defs.resolve_schedule_def("evals_nightly_ingest")(ctx)
    assert req.partition_key == DATE
    assert req.run_config == {"ops": {"evals__prompts": {"config": {"url": f"/data/evals/{DATE}.jsonl"}}}}


@pytest.mark.slow
def test_two_pipelines_materialize_for_one_date(tmp_path, tiny, monkeypatch):
    """Both pipelines, end to end for one date in one instance: ingest, every shard the day has,
    the rollup. Each writes under its own folder; a finished day's shard partitions are all
    materialized (no key of the day left missing)."""
    root = tmp_path / "data"
    monkeypatch.setenv("KVBATCH_ROOT", str(root))
    project = make_project(tmp_path / "proj", {
        "tickets": pipeline_yaml("tickets", str(tiny), "  shards: 4\n  sampling: {max_tokens: 3}\n"),
        "evals": pipeline_yaml("evals", str(tiny), "  shards: 10\n"),
    }, monkeypatch)
    defs = dg.load_from_defs_folder(path_within_project=project)
    instance = dg.DagsterInstance.ephemeral()
    for name, rows in (("tickets", 7), ("evals", 5)):
        data = tmp_path / f"{name}.jsonl"
        data.write_text(_rows(rows, name))
        ingest = defs.resolve_job_def(f"{name}_ingest").execute_in_process(
            partition_key=DATE, instance=instance,
            run_config={"ops": {f"{name}__prompts": {"config": {"url": str(data)}}}})
        assert ingest.success
        keys = instance.get_dynamic_partitions(shard_partitions_name(name))
        assert keys == [f"{DATE}|{i:04d}" for i in range(-(-rows // (4 if name == "tickets" else 10)))]
        for key in keys:
            assert defs.resolve_job_def(f"{name}_shard").execute_in_process(partition_key=key, instance=instance).success
        assert defs.resolve_job_def(f"{name}_rollup").execute_in_process(partition_key=DATE, instance=instance).success
        # A finished day: every shard partition it has is materialized.
        done = instance.get_materialized_partitions(dg.AssetKey([name, "decode_results"]))
        assert done == set(keys)
        [day] = pq.read_table(root / name / "cost_rollup" / f"date={DATE}" / "part.parquet").to_pylist()
        assert day["requests"] == rows
    assert not (root / "prompts").exists()  # nothing outside the pipelines' folders


def test_misspelt_attribute_fails_with_its_name_the_file_and_what_was_expected(tmp_path, monkeypatch):
    project = make_project(tmp_path / "proj", {
        "tickets": "type: kvbatch.BatchInference\nattributes:\n  name: tickets\n  modle: smollm2-135m\n"}, monkeypatch)
    with pytest.raises(Exception) as info:
        dg.load_from_defs_folder(path_within_project=project)
    text = "".join(__import__("traceback").format_exception(info.value))
    assert "'modle' is not an attribute of kvbatch.BatchInference (did you mean 'model'?)" in text
    assert "expected one of: name, model, input" in text
    assert str(project) in text and "defs.yaml" in text


@pytest.mark.parametrize("attribute, value, expected", [
    ("shards", "lots", "attributes.shards: Input should be a valid integer"),
    ("schedule", "'at two'", "attributes.schedule: Value error, schedule 'at two' is not a cron expression"),
    ("name", "'support tickets'", "attributes.name: Value error, name 'support tickets' must be a Python identifier"),
    ("dtype", "fp8", "attributes.dtype: Input should be 'fp32' or 'bf16'"),
])
def test_invalid_attribute_fails_with_the_file_line_attribute_and_expectation(tmp_path, monkeypatch, attribute, value,
                                                                               expected):
    attrs = {"name": "tickets", "model": "smollm2-135m", attribute: value}
    body = "".join(f"  {k}: {v}\n" for k, v in attrs.items())
    project = make_project(tmp_path / "proj", {"t": f"type: kvbatch.BatchInference\nattributes:\n{body}"}, monkeypatch)
    with pytest.raises(Exception) as info:
        dg.load_from_defs_folder(path_within_project=project)
    text = "".join(__import__("traceback").format_exception(info.value))
    line = 3 + list(attrs).index(attribute) if attribute != "name" else 3
    assert f"defs.yaml:{line}: {expected}" in text


def test_demo_defs_yaml_declares_the_default_pipeline(monkeypatch):
    """``defs/demo/defs.yaml`` is the code location's own pipeline, the environment's defaults
    included: the same spec ``factory.default_spec`` builds in Python."""
    from kvbatch.pipelines.component import BatchInference

    path = Path(__file__).resolve().parents[1] / "defs" / "demo" / "defs.yaml"
    for env in ({}, {"KVBATCH_MODEL": "/models/x", "KVBATCH_DTYPE": "bf16", "KVBATCH_DECODE_LAUNCHER": "local",
                     "KVBATCH_DECODE_WORLD_SIZE": "2"}):
        for k in ("KVBATCH_MODEL", "KVBATCH_DTYPE", "KVBATCH_DECODE_LAUNCHER", "KVBATCH_DECODE_WORLD_SIZE",
                  "KVBATCH_DECODE_IMAGE"):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        attributes = yaml.safe_load(path.read_text())["attributes"]
        component = BatchInference.resolve_from_yaml(yaml.safe_dump(attributes))
        assert component.pipeline_spec() == default_spec(), env


def test_scaffolder_writes_a_defs_yaml_that_loads(tmp_path, monkeypatch):
    """What ``dg scaffold defs kvbatch.BatchInference support_tickets`` runs (dagster's own
    ``scaffold_object``; the dg CLI is not installed here)."""
    from dagster.components.component_scaffolding import scaffold_object

    project = make_project(tmp_path / "proj", {}, monkeypatch)
    [defs_dir] = [p for p in project.iterdir() if p.name.startswith("proj_")]
    target = defs_dir / "defs" / "support_tickets"
    scaffold_object(target, "kvbatch.BatchInference", None, "yaml", project)
    text = (target / "defs.yaml").read_text()
    assert text.startswith("type: kvbatch.BatchInference\n") and "name: support_tickets" in text
    defs = dg.load_from_defs_folder(path_within_project=project)
    assert defs.resolve_schedule_def("support_tickets_nightly_ingest").cron_schedule == "0 2 * * *"


def test_factory_builds_the_same_pipeline_in_python():
    defs = dg.Definitions.merge(build_pipeline(PipelineSpec(name="a", model="smollm2-135m")),
                                build_pipeline(PipelineSpec(name="b", model="smollm2-135m", store="/kv/b")))
    dg.Definitions.validate_loadable(defs)
    assert {"a_model", "b_model", "b_kv_store", "kv_store"} <= set(defs.resources)
    with pytest.raises(Exception, match="pricing"):
        PipelineSpec(name="a", model="smollm2-135m", pricing={"usd_per_device_hour": {"cpu-host": -1}})


def test_import_kvbatch_loads_no_dagster():
    code = ("import sys, kvbatch; assert 'dagster' not in sys.modules; "
            "from kvbatch import BatchInference; assert 'dagster' in sys.modules; print(BatchInference.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "BatchInference", out.stderr[-2000:]


def test_day_shard_keys_are_exactly_the_days_shards():
    """Re-sharding a day into fewer shards deletes its higher keys and leaves other days alone."""
    instance = dg.DagsterInstance.ephemeral()
    register_day_shards(instance, "p", "2026-11-28", 3)
    register_day_shards(instance, "p", DATE, 10)
    assert register_day_shards(instance, "p", DATE, 4) == [f"{DATE}|{i:04d}" for i in range(4, 10)]
    keys = instance.get_dynamic_partitions("p_shards")
    assert sorted(keys) == sorted([f"2026-11-28|{i:04d}" for i in range(3)] + [f"{DATE}|{i:04d}" for i in range(4)])


def test_attributes_that_would_be_ignored_are_refused_and_the_rest_reach_the_definitions():
    """A JSON response format cannot be honoured by the pipeline's decode yet: refused, not
    ignored. Tags and owners reach every asset; a glob input leaves the schedule to the sensor."""
    with pytest.raises(Exception, match="response_format"):
        PipelineSpec(name="a", model="smollm2-135m", response_format={"type": "json_object"})
    defs = build_pipeline(PipelineSpec(name="t", model="smollm2-135m", input="s3://b/in/*.jsonl",
                                       tags={"team": "support"}, owners=["team:support"]))
    graph = defs.resolve_asset_graph()
    for key in graph.get_all_asset_keys():
        assert graph.get(key).tags.get("team") == "support" and graph.get(key).owners == ["team:support"]
    ctx = dg.build_schedule_context(scheduled_execution_time=__import__("datetime").datetime(2026, 11, 30, 2))
    skip = defs.resolve_schedule_def("t_nightly_ingest")(ctx)
    assert isinstance(skip, dg.SkipReason) and "t_new_dataset_files ingests its files" in skip.skip_message


def test_a_glob_input_is_what_the_new_file_sensor_watches(tmp_path):
    """``input`` with a glob: the pipeline's sensor ingests each matching file into the date its
    path names, with the pipeline's own step in the run config; other files are not touched."""
    (tmp_path / "tickets-2026-11-27.jsonl").write_text("{}\n")
    (tmp_path / "other-2026-11-27.jsonl").write_text("{}\n")
    defs = build_pipeline(PipelineSpec(name="t", model="smollm2-135m", input=str(tmp_path / "tickets-*.jsonl")))
    result = defs.resolve_sensor_def("t_new_dataset_files")(dg.build_sensor_context())
    [req] = result.run_requests
    assert req.partition_key == "2026-11-27"
    assert req.run_config == {"ops": {"t__prompts": {"config": {"url": str(tmp_path / "tickets-2026-11-27.jsonl")}}}}


def test_k8s_run_config_checks_a_pipelines_own_decode_cluster():
    """The Kubernetes run config names a pipeline's decode group by its key: it is checked too."""
    from kvbatch.pipelines.executor import k8s_execution_config

    run_config = {"execution": {"config": {"job_namespace": "kvbatch"}}, "resources": {"evals_decode_cluster": {
        "config": {"launcher": "kubernetes", "world_size": 2, "image": "img", "namespace": "other"}}}}
    with pytest.raises(ValueError, match="evals_decode_cluster.namespace 'other'"):
        k8s_execution_config(run_config)
