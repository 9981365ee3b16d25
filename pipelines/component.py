"""``kvbatch.BatchInference``: one pipeline declared in a ``defs.yaml`` (a Dagster component).

    type: kvbatch.BatchInference
    attributes:
      name: support_tickets
      input: s3://bucket/tickets/{date}.jsonl
      model: Qwen/Qwen3-8B
      schedule: "0 2 * * *"

The attributes are :class:`~kvbatch.pipelines.factory.PipelineSpec`'s fields and ``build_defs`` is
:func:`~kvbatch.pipelines.factory.build_pipeline`: the component adds only YAML (templates such
as ``{{ env('KVBATCH_MODEL', 'smollm2-135m') }}`` included) and error messages that name the file,
the line, the attribute and what was expected. ``dg scaffold defs kvbatch.BatchInference NAME``
writes a ``defs.yaml`` that loads (:class:`BatchInferenceScaffolder`).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import dagster as dg
from pydantic import BaseModel, ValidationError, model_validator

from kvbatch.pipelines.factory import PipelineSpec, build_pipeline, suggest

COMPONENT_TYPE = "kvbatch.BatchInference"


class BatchInferenceError(ValueError):
    """A ``defs.yaml`` of ``kvbatch.BatchInference`` that does not describe a pipeline."""


def _attributes() -> list[str]:
    return list(PipelineSpec.model_fields)


class BatchInferenceScaffolder(dg.Scaffolder):
    """``dg scaffold defs kvbatch.BatchInference NAME``: a ``defs.yaml`` naming the pipeline after
    its folder, on the bundled model, with every optional attribute shown commented out."""

    def scaffold(self, request: dg.ScaffoldRequest) -> None:
        request.target_path.mkdir(parents=True, exist_ok=True)
        (request.target_path / "defs.yaml").write_text(scaffold_yaml(request.type_name, request.target_path.name))


def scaffold_yaml(type_name: str, folder: str) -> str:
    """The ``defs.yaml`` the scaffolder writes for a pipeline in ``folder``."""
    name = "".join(c if c.isalnum() or c == "_" else "_" for c in folder) or "pipeline"
    if not name.isidentifier():
        name = f"p_{name}"
    return f"""type: {type_name}
attributes:
  name: {name}                          # prefixes every asset key, names the jobs, the group and the tables' folder
  model: smollm2-135m                   # a Hugging Face folder or URL, a .gguf file, or smollm2-135m
  input: s3://bucket/{name}/{{date}}.jsonl  # the nightly dataset; {{date}} is the day (a glob: the sensor ingests new files)
  schedule: "0 2 * * *"                 # cron of the nightly ingest (KVBATCH_TIMEZONE); off until turned on
  # dtype: bf16                         # fp32 (default) or bf16
  # weights: full                       # full, int8 or gguf
  # device: auto                        # auto, cpu, cuda or cuda:N
  # sampling: {{max_tokens: 256}}         # for rows that give none
  # response_format: {{type: text}}
  # spec: ngram                         # speculative decoding: ngram, draft:MODEL, early-exit:K, suffix:last-night
  # store: s3://bucket/kv               # this pipeline's own KV store (default: the shared <root>/kv)
  # response_cache: default             # exact response cache (a URL, or default: <root>/responses)
  # shards: 10000                       # rows per shard
  # pricing: {{usd_per_device_hour: {{cpu-host: 0.08}}}}
  # slo: {{ttft_s_p95_max: 30, tpot_s_p95_max: 1.0, severity: WARN}}
  # executor: in_process                # (default) or multiprocess, k8s
  # decode: {{launcher: in_process, world_size: 1}}
  # tags: {{team: support}}
  # owners: ["team:kvbatch"]
"""


@dg.scaffold_with(BatchInferenceScaffolder)
class BatchInference(dg.Component, dg.Resolvable, dg.Model, PipelineSpec):
    """A kvbatch batch-inference pipeline: its own asset chain (ingest -> shards -> prefill ->
    decode -> results -> cost), checks, jobs, schedule and sensors under its name."""

    @classmethod
    def get_spec(cls) -> dg.ComponentTypeSpec:
        return dg.ComponentTypeSpec(description=cls.__doc__, owners=["team:kvbatch"],
                                    produces=["asset", "asset_check", "job", "schedule", "sensor", "resource"])

    @classmethod
    @functools.cache
    def get_model_cls(cls) -> type[BaseModel]:
        derived = super().get_model_cls()

        class Attributes(derived):  # type: ignore[misc, valid-type]
            @model_validator(mode="before")
            @classmethod
            def _known(cls, data: Any) -> Any:
                # Dagster names the file and line; this names the attribute and what was expected.
                if isinstance(data, dict):
                    known = _attributes()
                    for key in data:
                        if key not in known:
                            raise ValueError(f"{key!r} is not an attribute of {COMPONENT_TYPE}"
                                             f"{suggest(str(key), known)}; expected one of: {', '.join(known)}")
                return data

        Attributes.__name__ = derived.__name__
        return Attributes

    @classmethod
    def resolve_from_model(cls, context: dg.ResolutionContext, model: BaseModel) -> BatchInference:
        try:
            return super().resolve_from_model(context, model)
        except ValidationError as exc:
            raise BatchInferenceError(_explain(exc, context)) from None

    def pipeline_spec(self) -> PipelineSpec:
        """These attributes as the plain :class:`PipelineSpec` the factory takes."""
        # Already validated as this component (a PipelineSpec): not validated a second time.
        return PipelineSpec.model_construct(**{k: getattr(self, k) for k in PipelineSpec.model_fields})

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        return build_pipeline(self.pipeline_spec())


def _explain(exc: ValidationError, context: dg.ResolutionContext) -> str:
    """Each error of ``exc`` as ``<file>:<line>: attributes.<name>: <what was expected>``."""
    tree = context.source_position_tree
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        where = "<attributes>"
        if tree is not None:
            position, _ = tree.lookup_closest_and_path([*context.path, *loc], None)
            where = f"{Path(position.filename)}:{position.start.line}" if position else str(tree.position.filename)
        got = f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) else ""
        lines.append(f"{where}: attributes.{'.'.join(loc) or '?'}: {err['msg']}{got}")
    return f"invalid {COMPONENT_TYPE}:\n  " + "\n  ".join(lines)
