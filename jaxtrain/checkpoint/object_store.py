"""Object-store locations (``s3://bucket/key``, ``gs://bucket/key``) for checkpoints and token shards.

Two layers reach the store, each with its own client, both configured from the environment as the clouds' SDKs are:

- Arrays: TensorStore's own ``s3`` and ``gcs`` kvstore drivers (Orbax writes every array shard through them).
  Orbax 0.12 builds a ``gcs`` spec for ``gs://`` paths itself but treats any other path as a local file name
  ("Checkpoint path should be absolute"); :func:`teach_orbax_s3` makes it build TensorStore's ``s3`` spec instead.
- Directories and small files (step listing, the JSON ``meta`` item, Orbax's temporary-directory rename): Orbax
  goes through ``etils.epath``, which hands ``s3://`` to ``s3fs`` and ``gs://`` to ``gcsfs`` (fsspec).

S3 settings, read by botocore (s3fs) and TensorStore alike: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` (or
a profile / instance role), ``AWS_REGION`` (or ``AWS_DEFAULT_REGION``), and for an S3-compatible server (MinIO,
Ceph, a test server) the endpoint in ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``. TensorStore does not read the
endpoint variables itself, so the spec built here passes the same value in its ``endpoint`` field. GCS: application
default credentials (``GOOGLE_APPLICATION_CREDENTIALS`` or the metadata server), read by gcsfs and TensorStore.

The URL checks that config validation runs before the runtime starts (no JAX) are in :mod:`jaxtrain.rundir`.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from etils import epath

from jaxtrain.errors import ConfigError, one_line
from jaxtrain.rundir import absolute, endpoint, is_remote, join, kvstore_spec, s3_kvstore, split_url

__all__ = ["absolute", "endpoint", "is_remote", "join", "kvstore_spec", "s3_kvstore", "split_url", "teach_orbax_s3",
           "write_probe"]


def teach_orbax_s3() -> None:
    """Make Orbax 0.12's TensorStore spec builder write ``s3://`` paths through TensorStore's ``s3`` driver.

    Orbax decides per path between its ``gcs`` spec and a local ``file`` spec (``_use_gcs_driver``), after
    normalising it with ``os.path.normpath`` (which turns ``s3://`` into ``s3:/``). Both are wrapped so that an
    ``s3://`` path takes the object-store branch and gets :func:`s3_kvstore`'s spec; every other path is handled as
    before. Idempotent. Orbax internals: where their names differ (another Orbax version), s3:// saves fail with
    Orbax's own message, and nothing else changes.
    """
    try:
        tsu: Any = importlib.import_module("orbax.checkpoint._src.serialization.tensorstore_utils")
    except ImportError:
        return
    gcs: Any = getattr(tsu, "gcs_utils", None)
    needed: tuple[Any, Any, Any] = (getattr(tsu, "_use_gcs_driver", None), getattr(tsu, "_normalize_path", None),
              getattr(gcs, "get_kvstore_for_gcs", None))
    if None in needed or getattr(tsu._use_gcs_driver, "_jaxtrain_s3", False):
        return
    use_gcs, normalize, gcs_spec = needed

    def _use_object_store(directory: str) -> bool:
        return str(directory).startswith("s3://") or use_gcs(directory)

    def _normalize(path: str) -> str:
        text = str(path)
        return "s3://" + os.path.normpath(text[5:]).lstrip("/") if text.startswith("s3://") else normalize(path)

    def _kvstore(path: str) -> dict[str, Any]:
        return s3_kvstore(path) if str(path).startswith("s3://") else gcs_spec(path)

    _use_object_store._jaxtrain_s3 = True  # type: ignore[attr-defined]
    tsu._use_gcs_driver, tsu._normalize_path = _use_object_store, _normalize
    gcs.get_kvstore_for_gcs = _kvstore


def write_probe(directory: str) -> None:
    """ConfigError unless a file can be written into ``directory`` (created here): on an object store this is where
    a missing bucket, a wrong endpoint or refused credentials show, before the first step."""
    try:
        if is_remote(directory):
            scheme, bucket, _ = split_url(directory)
            # s3fs's mkdir would create a missing bucket (with whatever defaults the account has): refuse instead.
            # An object store has no directories to make: its keys are written as they come.
            if not epath.Path(f"{scheme}://{bucket}").exists():
                where = f" at {endpoint()}" if scheme == "s3" and endpoint() else ""
                raise ConfigError(f"checkpoint directory {directory!r}: bucket {bucket!r} does not exist{where} (or "
                                  "these credentials cannot see it); create it first")
        else:
            epath.Path(directory).mkdir(parents=True, exist_ok=True)
        probe = epath.Path(directory, f".write-probe-{os.getpid()}")
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        why = e.strerror or one_line(e, 400)
        raise ConfigError(f"checkpoint directory {directory!r} is not writable: {why}") from None
    except Exception as e:  # botocore / google-auth errors from s3fs, gcsfs (an endpoint that does not answer)
        if isinstance(e, ConfigError) or not is_remote(directory):
            raise
        raise ConfigError(f"checkpoint directory {directory!r} is not writable: {one_line(e, 400)}") from None
