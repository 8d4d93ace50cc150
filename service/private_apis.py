"""The private APIs of other packages that rayeval relies on, and a start-up check of each.

Some of what rayeval does has no public API in the packages it builds on: an attribute with a
leading underscore, a module-level name it replaces, a private module. Each is listed here once
(:data:`PRIVATE_APIS`) with the version of its package it was checked against and what rayeval
does when it is gone; :func:`check_private_apis` looks for every one of them (once per process,
when an engine starts) and names the package and both versions for each that moved. Where rayeval
has a fallback the check warns (results stay right; something is slower or uses more memory);
where it has none the check raises, before any rank starts, instead of failing half-way.
Imports the packages lazily: the API process reads the table without importing torch.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
from dataclasses import dataclass

from rayeval.actors.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrivateApi:
    """One private name rayeval uses.

    Args:
        package: The distribution that provides it (for its installed version).
        module: The module to import.
        name: The attribute looked up on the module (dotted for a class attribute).
        checked: The package version it was last checked against.
        used_by: Where rayeval uses it and for what.
        fallback: What rayeval does without it (empty: nothing; the check raises).
        instance: The name is an attribute of an instance (built with no arguments), not of
            the class.
    """

    package: str
    module: str
    name: str
    checked: str
    used_by: str
    fallback: str = ""
    instance: bool = False


PRIVATE_APIS: tuple[PrivateApi, ...] = (
    PrivateApi(
        "torch",
        "torch.distributed.fsdp",
        "FSDPModule._set_unshard_async_op",
        "2.13.0",
        "actors/parallel/fsdp_units.py: CPU ranks free each all-gathered unit at once",
        "keeps one more all-gathered unit alive per forward (more memory per rank)",
    ),
    PrivateApi(
        "torch",
        "torch.distributed.tensor",
        "DTensor.__create_chunk_list__",
        "2.13.0",
        "actors/weights/sources.py: where a rank's DTensor shard lies in a checkpoint tensor "
        "(DCP's own description of it)",
    ),
    PrivateApi(
        "transformers",
        "transformers.modeling_utils",
        "PreTrainedModel._no_split_modules",
        "5.25.0",
        "actors/parallel/fsdp_units.py: which modules are decoder blocks (one FSDP unit each)",
        "the children of the model's longest ModuleList are taken as its blocks",
    ),
    PrivateApi(
        "transformers",
        "transformers.distributed.tensor_parallel",
        "TensorParallelLayer.transform_output_post_forward",
        "5.25.0",
        "actors/parallel/tp_exact.py: tensor-parallel layers split by output features "
        "(no split sums)",
        "",
    ),
    PrivateApi(
        "transformers",
        "transformers.distributed.parallel_utils",
        "ALL_PARALLEL_STYLES.register",
        "5.25.0",
        "actors/parallel/tp_exact.py: rayeval's exact tensor-parallel styles registered by name",
        "",
    ),
    PrivateApi(
        "transformers",
        "transformers.configuration_utils",
        "PretrainedConfig._attn_implementation",
        "5.25.0",
        "actors/compute/scoring.py, engine/lm.py: which attention takes a packed row's 4D mask",
        "",
    ),
    PrivateApi(
        "transformers",
        "transformers.generation.utils",
        "GenerationMixin._prepare_generation_config",
        "5.25.0",
        "actors/compute/logits_setup.py: continuous batching applies generate's own "
        "generation config",
        "generate_until runs in static batches",
    ),
    PrivateApi(
        "transformers",
        "transformers.generation.utils",
        "GenerationMixin._prepare_special_tokens",
        "5.25.0",
        "actors/compute/logits_setup.py: the EOS ids that generate's length processors read",
        "generate_until runs in static batches",
    ),
    PrivateApi(
        "transformers",
        "transformers.generation.utils",
        "GenerationMixin._get_logits_processor",
        "5.25.0",
        "actors/compute/logits_setup.py: continuous batching applies generate's own "
        "logits processors",
        "generate_until runs in static batches",
    ),
    PrivateApi(
        "transformers",
        "transformers.cache_utils",
        "DynamicLayer.keys",
        "5.25.0",
        "actors/compute/continuous.py: rows' KV caches joined, dropped and trimmed",
        "generate_until runs in static batches",
        instance=True,
    ),
    PrivateApi(
        "lm_eval",
        "lm_eval._cli.run",
        "Run._parser",
        "0.4.13",
        "api/cli: rayeval run and submit reuse lm-eval's own run flags",
        "",
    ),
    PrivateApi(
        "lm_eval",
        "lm_eval.config.evaluate_config",
        "EvaluatorConfig._configure",
        "0.4.13",
        "service/vocabulary/config.py, api/cli: lm-eval's own validation of an evaluation's "
        "options",
        "",
    ),
    PrivateApi(
        "ray",
        "ray._raylet",
        "PlacementGroupID",
        "2.60.0",
        "service/jobs/ray_resources.py: a placement group found by name is removed by id",
        "",
    ),
)


def missing(api: PrivateApi) -> bool:
    """Whether ``api`` is gone from the installed package (or its module does not import)."""
    try:
        target: object = importlib.import_module(api.module)
    except ImportError:
        return True
    parts = api.name.split(".")
    for index, part in enumerate(parts):
        if part == "_parser" and isinstance(target, type):
            return not _has_instance_parser(target)
        if api.instance and index == len(parts) - 1 and isinstance(target, type):
            try:
                target = target()
            except Exception:
                return True
        if not hasattr(target, part):
            return True
        target = getattr(target, part)
    return False


def _has_instance_parser(run_class: type) -> bool:
    """lm-eval's ``Run`` sets ``_parser`` on the instance ``create`` builds."""
    import argparse

    try:
        subparsers = argparse.ArgumentParser().add_subparsers()
        parser = run_class.create(subparsers)._parser  # type: ignore[attr-defined]
        return isinstance(parser, argparse.ArgumentParser)
    except Exception:
        return False


@functools.cache
def check_private_apis() -> list[str]:
    """Look for every private API once per process.

    Returns:
        A warning per API that moved and that rayeval can do without (also logged).

    Raises:
        ConfigError: an API rayeval cannot do without moved, naming the package, the installed
            and the checked versions, and where rayeval uses it.
    """
    warnings, errors = [], []
    for api in PRIVATE_APIS:
        if not missing(api):
            continue
        installed = _version(api.package)
        what = (
            f"{api.package} {installed} has no {api.module}.{api.name} (checked with "
            f"{api.package} {api.checked}; used by {api.used_by})"
        )
        if api.fallback:
            warnings.append(f"{what}: {api.fallback}")
        else:
            errors.append(what)
    for warning in warnings:
        logger.warning("%s", warning)
    if errors:
        raise ConfigError(
            "; ".join(errors) + ". Install the checked versions (pip install -e . pins them), or "
            "report the new version to rayeval"
        )
    return warnings


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"
