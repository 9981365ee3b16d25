"""Many pipelines in one deployment: ``build_pipeline(spec) -> Definitions``.

A :class:`PipelineSpec` says what one nightly batch is (its name, dataset, model, schedule,
defaults, prices and SLOs); :func:`build_pipeline` turns it into that pipeline's own asset chain
(``prompts -> prompt_shards -> prefill_kv -> decode_results -> cost_metrics -> cost_rollup``,
every key under ``[name]``, in group ``name``), its checks, its jobs (``<name>_ingest``,
``<name>_prefill``, ``<name>_decode``, ``<name>_shard``, ``<name>_rollup``), its schedule
(``<name>_nightly_ingest``) and sensors (``<name>_shards_after_ingest``,
``<name>_rollup_after_shard``, ``<name>_rollup_after_failed_shard``, ``<name>_new_dataset_files``). The Dagster component
(:mod:`kvbatch.pipelines.component`, ``type: kvbatch.BatchInference`` in a ``defs.yaml``) is a
thin layer over this function, for teams that declare pipelines in YAML.

Resources. Dagster binds a resource by key for the whole code location, so what differs between
pipelines has a key of its own and what is shared has one key:

- shared: ``object_store`` (the deployment's root; each pipeline's steps see it re-rooted at
  ``<root>/<name>``, so tables never collide, see :meth:`ObjectStoreResource.under`),
  ``kv_store`` (``<root>/kv``: blocks are content-addressed under the model's fingerprint, so
  pipelines whose model matches share prefixes and others never collide) and
  ``pipes_subprocess_client``; one object each (built once per process from the environment),
  as ``Definitions.merge`` requires;
- per pipeline: ``<name>_model``, ``<name>_pricing``, ``<name>_decode_cluster``, and
  ``<name>_kv_store`` when the pipeline sets its own ``store`` or ``response_cache``.

The steps' bodies are plain functions (``assets``, ``rollup``) that take resources by kind
(``model``, ``pricing``...); :meth:`PipelineParts.asset` wraps one as an asset of a pipeline,
fetching each resource under that pipeline's key.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import json
import os
import re
from collections.abc import Callable, Mapping
from typing import Any, Literal

import dagster as dg
from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from kvbatch.resources import (
    DecodeClusterResource,
    KVStoreResource,
    ModelResource,
    ObjectStoreResource,
    PricingResource,
)
from kvbatch.resources.model import check_device, check_spec

DEFAULT_NAME = "kvbatch"
DEFAULT_OWNERS = ("team:kvbatch",)
# Resource kinds a step body may take, and whether every pipeline shares one of it.
SHARED_KINDS = ("object_store", "pipes_subprocess_client")
PER_PIPELINE_KINDS = ("model", "pricing", "decode_cluster")


@functools.lru_cache(maxsize=1024)
def _resource_from_json(cls: type, args: str) -> Any:
    return cls(**json.loads(args))


def resource(cls: type, **kwargs: Any) -> Any:
    """``cls(**kwargs)``, one object per distinct configuration in this process: a Dagster
    resource infers its config schema when built (tens of ms), and pipelines that share a model,
    prices or a decode group share the object (``load`` of 50 pipelines: benchmarks/bench_components.py)."""
    return _resource_from_json(cls, json.dumps(kwargs, sort_keys=True, default=str))


def _none_if_blank(value: Any) -> Any:
    # A YAML template of an unset variable (`{{ env('X', '') }}`) renders "": that means "not given".
    return None if isinstance(value, str) and not value.strip() else value


class SamplingDefaults(dg.Resolvable, BaseModel):
    """Sampling applied to rows of the dataset that give none."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(default=256, description="max_tokens of rows that give none")

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"max_tokens must be >= 1, got {v}")
        return v


class ResponseFormat(dg.Resolvable, BaseModel):
    """The response format of rows that give none. The pipeline's decode has no constrained
    decoding yet (rows asking for JSON are rejected at ingest, naming the field), so only
    ``text`` is accepted: a JSON format here would be silently ignored otherwise."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["text"] = Field(default="text", description="text (json_schema / json_object: not in the "
                                                                "pipeline yet; use kvbatch serve or generate)")


class SLOSpec(dg.Resolvable, BaseModel):
    """The latency SLO of the checks on ``cost_metrics`` and ``cost_rollup`` (unset: the
    ``KVBATCH_SLO_*`` environment, else 30 s TTFT, 1 s TPOT, WARN)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ttft_s_p95_max: float | None = Field(default=None, description="P95 time to first token, seconds")
    tpot_s_p95_max: float | None = Field(default=None, description="P95 time per output token, seconds")
    severity: Literal["WARN", "ERROR"] | None = Field(default=None, description="how a breach shows")

    @field_validator("ttft_s_p95_max", "tpot_s_p95_max")
    @classmethod
    def _positive(cls, v: float | None) -> float | None:
        if v is not None and v <= 0:
            raise ValueError(f"an SLO must be > 0 seconds, got {v}")
        return v


class PipelineSpec(BaseModel):
    """One pipeline of a deployment. Unset optional fields take the defaults of the resources
    (``ModelResource``, ``KVStoreResource``, ``PricingResource``, ``DecodeClusterResource``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="a Python identifier: prefixes every asset key, names the jobs, "
                                  "schedule, sensors, group and the folder of the pipeline's tables")
    model: str = Field(description="a Hugging Face folder (local or fsspec URL), a .gguf file or smollm2-135m")
    input: str | None = Field(default=None, description=(
        "the nightly dataset: a URL with {date} for the day (the schedule and a run without a url read it), "
        "or a glob (*) whose new files the new_dataset_files sensor ingests; default KVBATCH_NIGHTLY_DATASET"))
    schedule: str = Field(default="0 2 * * *", description="cron of the nightly ingest, in KVBATCH_TIMEZONE")
    dtype: Literal["fp32", "bf16"] = Field(default="fp32", description="weights, activations and KV cache")
    weights: Literal["full", "int8", "gguf"] = Field(default="full", description="dense projection weights")
    device: str = Field(default="auto", description="auto (CUDA when present), cpu, cuda or cuda:N")
    sampling: SamplingDefaults = Field(default_factory=SamplingDefaults,
                                       description="sampling of rows that give none")
    response_format: ResponseFormat | None = Field(default=None, description="text only (see ResponseFormat)")
    spec: str | None = Field(default=None, description="speculative decoding: ngram, draft:MODEL or early-exit:K")
    store: str | None = Field(default=None, description="the KV store's durable tier (default <root>/kv, shared)")
    response_cache: str | None = Field(default=None, description="exact response cache: a URL, or 'default' "
                                                                 "for <root>/responses; unset: off")
    shards: int | None = Field(default=None, description="rows per shard: a day gets ceil(rows / shards) shards "
                                                         "(default KVBATCH_MAX_ROWS_PER_SHARD, else 10000)")
    pricing: dict[str, Any] = Field(default_factory=dict, description="PricingResource fields")
    slo: SLOSpec = Field(default_factory=SLOSpec, description="latency SLO of the checks")
    executor: Literal["in_process", "multiprocess", "k8s"] | None = Field(default=None, description=(
        "the executor of this pipeline's jobs (default: the code location's, KVBATCH_EXECUTOR, in_process)"))
    decode: dict[str, Any] = Field(default_factory=dict, description="the decode worker group: "
                                                                     "DecodeClusterResource fields")
    tags: dict[str, str] = Field(default_factory=dict, description="tags on every asset")
    owners: list[str] = Field(default_factory=lambda: list(DEFAULT_OWNERS), description="owners of every asset")

    @field_validator("input", "spec", "store", "response_cache", "executor", "response_format", mode="before")
    @classmethod
    def _blank_is_unset(cls, v: Any) -> Any:
        return _none_if_blank(v)

    @field_validator("decode", "pricing", mode="before")
    @classmethod
    def _drop_blank(cls, v: Any) -> Any:
        return {k: x for k, x in v.items() if _none_if_blank(x) is not None} if isinstance(v, Mapping) else v

    @field_validator("name")
    @classmethod
    def _check_name(cls, v: str) -> str:
        if not v.isidentifier() or not v.isascii():
            raise ValueError(f"name {v!r} must be a Python identifier (letters, digits, _; not starting with a "
                             "digit): it becomes asset keys, job names and a folder")
        return v

    @field_validator("schedule")
    @classmethod
    def _check_cron(cls, v: str) -> str:
        from dagster._utils.schedules import is_valid_cron_string

        if not is_valid_cron_string(v):
            raise ValueError(f"schedule {v!r} is not a cron expression (five fields, e.g. '0 2 * * *')")
        return v

    @field_validator("shards")
    @classmethod
    def _check_shards(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"shards (rows per shard) must be >= 1, got {v}")
        return v

    @field_validator("device")
    @classmethod
    def _check_device(cls, v: str) -> str:
        return check_device(v)

    @field_validator("spec")
    @classmethod
    def _check_spec(cls, v: str | None) -> str | None:
        return check_spec(v)

    @field_validator("pricing")
    @classmethod
    def _check_pricing(cls, v: dict[str, Any]) -> dict[str, Any]:
        resource(PricingResource, **v)  # raises naming the bad rate or key
        return v

    @field_validator("decode")
    @classmethod
    def _check_decode(cls, v: dict[str, Any]) -> dict[str, Any]:
        cluster = resource(DecodeClusterResource, **v)
        return {k: getattr(cluster, k) for k in v}  # typed: "2" from a template and 2 are one spec

    @field_validator("owners")
    @classmethod
    def _check_owners(cls, v: list[str]) -> list[str]:
        from dagster._core.definitions.utils import validate_asset_owner

        for owner in v:
            validate_asset_owner(owner, dg.AssetKey("x"))
        return v

    @model_validator(mode="after")
    def _check_model(self) -> PipelineSpec:
        self.model_resource()
        return self

    def model_resource(self) -> ModelResource:
        return resource(ModelResource, model=self.model, dtype=self.dtype, device=self.device, weights=self.weights,
                        spec=self.spec)


def default_spec(environ: Mapping[str, str] | None = None) -> PipelineSpec:
    """The code location's own pipeline, as ``defs/demo/defs.yaml`` declares it: ``kvbatch``, its
    model and decode group from the environment (``KVBATCH_MODEL``, ``KVBATCH_DTYPE``,
    ``KVBATCH_DECODE_LAUNCHER`` / ``_WORLD_SIZE`` / ``_IMAGE``)."""
    env = os.environ if environ is None else environ
    decode = {"launcher": env.get("KVBATCH_DECODE_LAUNCHER"), "world_size": env.get("KVBATCH_DECODE_WORLD_SIZE"),
              "image": env.get("KVBATCH_DECODE_IMAGE")}
    return PipelineSpec(name=DEFAULT_NAME, model=env.get("KVBATCH_MODEL", "smollm2-135m"),
                        dtype=env.get("KVBATCH_DTYPE", "fp32"), decode=decode)  # type: ignore[arg-type]


def _env_secret(name: str) -> dg.EnvVar | None:
    return dg.EnvVar(name) if os.environ.get(name) else None


@functools.cache
def _shared(environ: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    env = dict(environ)
    return {
        "object_store": ObjectStoreResource(
            url=env.get("KVBATCH_ROOT") or os.path.abspath("kvbatch_data"),
            endpoint_url=env.get("KVBATCH_S3_ENDPOINT_URL"), region=env.get("KVBATCH_S3_REGION"),
            access_key_id=_env_secret("AWS_ACCESS_KEY_ID"), secret_access_key=_env_secret("AWS_SECRET_ACCESS_KEY")),
        "kv_store": KVStoreResource(url=env.get("KVBATCH_KV_URL")),
        "pipes_subprocess_client": dg.PipesSubprocessClient(),
    }


SHARED_ENV = ("KVBATCH_ROOT", "KVBATCH_S3_ENDPOINT_URL", "KVBATCH_S3_REGION", "KVBATCH_KV_URL",
              "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


def shared_resources() -> dict[str, Any]:
    """The resources every pipeline shares, from the environment (``KVBATCH_ROOT``,
    ``KVBATCH_S3_ENDPOINT_URL``, ``KVBATCH_S3_REGION``, ``KVBATCH_KV_URL``, AWS credentials as
    ``EnvVar``\\ s): the same objects for every pipeline built in this process."""
    return dict(_shared(tuple((k, os.environ[k]) for k in SHARED_ENV if k in os.environ)))


def resource_key(pipeline: str, kind: str, spec: PipelineSpec | None = None) -> str:
    """The key a pipeline's step finds a resource of ``kind`` under (module docstring)."""
    if kind in SHARED_KINDS:
        return kind
    if kind == "kv_store":
        return f"{pipeline}_kv_store" if spec is not None and (spec.store or spec.response_cache) else "kv_store"
    if kind in PER_PIPELINE_KINDS:
        return f"{pipeline}_{kind}"
    raise ValueError(f"no resource kind {kind!r}; known: {[*SHARED_KINDS, 'kv_store', *PER_PIPELINE_KINDS]}")


def pipeline_resources(spec: PipelineSpec, by_kind: Mapping[str, Any]) -> dict[str, Any]:
    """``by_kind`` (``{"object_store": ..., "model": ...}``, as a test or a script builds them)
    keyed as ``spec``'s steps look them up."""
    return {resource_key(spec.name, kind, spec): value for kind, value in by_kind.items()}


def pipeline_resource_defs(spec: PipelineSpec) -> dict[str, Any]:
    """The per-pipeline resources ``spec`` declares."""
    by_kind: dict[str, Any] = {
        "model": spec.model_resource(),
        "pricing": resource(PricingResource, **spec.pricing),
        "decode_cluster": resource(DecodeClusterResource, **spec.decode),
    }
    if spec.store or spec.response_cache:
        by_kind["kv_store"] = resource(KVStoreResource, url=spec.store, response_cache=spec.response_cache)
    return pipeline_resources(spec, by_kind)


def _with_defaults(base: type[dg.Config], name: str, defaults: Mapping[str, Any]) -> type[dg.Config]:
    """``base`` with other field defaults (a pipeline's own), as a subclass Dagster shows in the Launchpad."""
    from pydantic.fields import FieldInfo

    # The base field with only its default changed (its checks, such as ge=1, still hold); a default
    # equal to the base's needs no class of its own (each class costs a config-schema inference).
    fields = {k: (base.model_fields[k].annotation, FieldInfo.merge_field_infos(base.model_fields[k], default=v))
              for k, v in defaults.items() if v is not None and v != base.model_fields[k].default}
    if not fields:
        return base
    return create_model(f"{base.__name__}_{name}", __base__=base, **fields)  # type: ignore[call-overload]


class PipelineParts:
    """What a pipeline's builders share: its spec, keys, partitions and config classes."""

    def __init__(self, spec: PipelineSpec):
        from kvbatch.pipelines.assets import PromptsConfig, ShardsConfig
        from kvbatch.pipelines.checks import SLOConfig
        from kvbatch.pipelines.partitions import shard_partitions

        self.spec = spec
        self.name = spec.name
        self.shards = shard_partitions(spec.name)
        self.prompts_config = _with_defaults(PromptsConfig, spec.name, {
            "url": spec.input, "default_max_tokens": spec.sampling.max_tokens})
        self.shards_config = _with_defaults(ShardsConfig, spec.name, {"max_rows_per_shard": spec.shards})
        self.slo_config = _with_defaults(SLOConfig, spec.name, {
            "ttft_s_p95_max": spec.slo.ttft_s_p95_max, "tpot_s_p95_max": spec.slo.tpot_s_p95_max,
            "slo_severity": spec.slo.severity})
        self.owners = list(spec.owners)

    def key(self, asset: str) -> dg.AssetKey:
        return dg.AssetKey([self.name, asset])

    def resource_key(self, kind: str) -> str:
        return resource_key(self.name, kind, self.spec)

    def _fetch(self, context: dg.AssetExecutionContext, kinds: list[str]) -> dict[str, Any]:
        out = {}
        for kind in kinds:
            value = getattr(context.resources, self.resource_key(kind))
            # Each pipeline's tables live under its own folder of the shared store.
            out[kind] = value.under(self.name) if kind == "object_store" else value
        return out

    def compute_fn(self, body: Callable, config_cls: type[dg.Config] | None) -> tuple[Callable, set[str]]:
        """``body(context, [config], **resources by kind)`` as a Dagster compute function of this
        pipeline, and the resource keys it requires."""
        params = [p for p in inspect.signature(body).parameters if p not in ("context", "config")]
        keys = {self.resource_key(p) for p in params}
        takes_config = config_cls is not None
        fetch = self._fetch

        if inspect.isgeneratorfunction(body):
            def compute(context, config=None):
                args = (context, config) if takes_config else (context,)
                yield from body(*args, **fetch(context, params))
        else:
            def compute(context, config=None):
                args = (context, config) if takes_config else (context,)
                return body(*args, **fetch(context, params))
        if takes_config:
            compute.__signature__ = inspect.Signature([  # type: ignore[attr-defined]
                inspect.Parameter("context", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                  annotation=dg.AssetExecutionContext),
                inspect.Parameter("config", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=config_cls)])
            compute.__annotations__ = {"context": dg.AssetExecutionContext, "config": config_cls}
        else:
            compute.__signature__ = inspect.Signature([  # type: ignore[attr-defined]
                inspect.Parameter("context", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                  annotation=dg.AssetExecutionContext)])
            compute.__annotations__ = {"context": dg.AssetExecutionContext}
        compute.__name__ = f"{self.name}__{body.__name__.strip('_')}"
        compute.__doc__ = body.__doc__
        return compute, keys

    def asset(self, body: Callable, *, name: str, config: type[dg.Config] | None = None,
              **kwargs: Any) -> dg.AssetsDefinition:
        """``body`` as the asset ``[pipeline, name]`` of this pipeline's group."""
        fn, keys = self.compute_fn(body, config)
        return dg.asset(key=self.key(name), group_name=self.name, owners=self.owners, tags=dict(self.spec.tags),
                        description=ui_description(body.__doc__), required_resource_keys=keys,
                        **kwargs)(fn)

    def multi_asset(self, body: Callable, *, name: str, deps: list, partitions_def: dg.PartitionsDefinition,
                    kinds: set[str], check_specs: list[dg.AssetCheckSpec], config: type[dg.Config] | None = None,
                    **kwargs: Any) -> dg.AssetsDefinition:
        """``body`` as a single-asset ``multi_asset(can_subset=True)`` (module ``assets``: why)."""
        fn, keys = self.compute_fn(body, config)
        spec = dg.AssetSpec(self.key(name), deps=deps, partitions_def=partitions_def, group_name=self.name,
                            kinds=kinds, owners=self.owners, tags=dict(self.spec.tags),
                            description=ui_description(body.__doc__))
        return dg.multi_asset(name=f"{self.name}__{name}", specs=[spec], check_specs=check_specs, can_subset=True,
                              required_resource_keys=keys, **kwargs)(fn)


def ui_description(doc: str | None) -> str:
    """A step's docstring as the UI shows it: Markdown, whose previews (the catalog's one-line
    descriptions) print it raw, so reST's ``double backticks`` and ``:func:`x``` roles become
    single backticks."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", inspect.cleandoc(doc or ""))
    return text.replace("``", "`")


class Pipeline:
    """A built pipeline: its definitions and its parts by name (for tests and scripts)."""

    def __init__(self, spec: PipelineSpec):
        from kvbatch.pipelines.assets import build_assets
        from kvbatch.pipelines.automation import build_automation
        from kvbatch.pipelines.executor import executor_def
        from kvbatch.pipelines.rollup import build_rollup_assets

        parts = PipelineParts(spec)
        self.spec, self.parts = spec, parts
        self.assets = {a.key.path[-1]: a for a in [*build_assets(parts), *build_rollup_assets(parts)]}
        executor = executor_def(spec.executor) if spec.executor else None
        automation = build_automation(parts, self.assets, executor)
        self.jobs, self.schedules, self.sensors = automation.jobs, automation.schedules, automation.sensors
        self.resources = {**shared_resources(), **pipeline_resource_defs(spec)}

    def job(self, suffix: str) -> dg.UnresolvedAssetJobDefinition:
        return self.jobs[f"{self.spec.name}_{suffix}"]

    def definitions(self) -> dg.Definitions:
        return dg.Definitions(assets=list(self.assets.values()), jobs=list(self.jobs.values()),
                              schedules=list(self.schedules.values()), sensors=list(self.sensors.values()),
                              resources=self.resources)


def build_pipeline(spec: PipelineSpec) -> dg.Definitions:
    """One pipeline's definitions (module docstring). Merge several with ``dg.Definitions.merge``:
    their shared resources are the same objects, their own ones are keyed by name."""
    return Pipeline(spec).definitions()


@functools.cache
def default_pipeline() -> Pipeline:
    """The code location's own pipeline (:func:`default_spec`), built once per process: the
    module-level names of ``kvbatch.pipelines.default``."""
    return Pipeline(default_spec())


def suggest(name: str, known: list[str]) -> str:
    """`` (did you mean 'x'?)`` for a misspelt name, else ``""``."""
    close = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
