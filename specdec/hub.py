"""Where a model name points (a local dir or a hub id), checked before `from_pretrained` runs.

`from_pretrained` on a missing path raises a validation error that names no fix, and on a machine with
no network it retries for most of a minute before its OSError. `pretrained(load, name, what)` answers in
seconds with one `ModelSourceError` (a ValueError) naming what was tried and the fix: an existing dir, a
token, `HF_HUB_OFFLINE=1`, a network. A hub id already in the local cache loads from it when the hub
cannot be reached.

    from specdec.hub import pretrained
    model = pretrained(AutoModelForCausalLM.from_pretrained, "org/name", "--target", dtype=torch.float32)
"""
from __future__ import annotations

import functools
import logging
import os
import re
import socket
from typing import Any, Callable, Optional
from urllib.parse import urlparse

log = logging.getLogger(__name__)

# what a hub id looks like: name or org/name (letters, digits, . _ -)
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
PROBE_TIMEOUT_S = 3.0


class ModelSourceError(ValueError):
    """A model name that names no existing dir and no hub model this machine can load."""


def looks_local(name: str) -> bool:
    """True for a name that can only be a path: it exists, or it is not shaped like a hub id (absolute,
    ./ or ~, more than one '/')."""
    return os.path.exists(os.path.expanduser(name)) or not HUB_ID.match(name)


def endpoint() -> str:
    """The hub's URL (HF_ENDPOINT, read now, or huggingface_hub's default)."""
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT") or constants.ENDPOINT


def offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set: only the local cache may be read."""
    from huggingface_hub import constants

    return constants.is_offline_mode()  # the flag huggingface_hub read from the environment at import


@functools.lru_cache(maxsize=8)
def unreachable(url: str) -> Optional[str]:
    """Why a TCP connection to url's host fails within PROBE_TIMEOUT_S, or None when it connects (or a
    proxy is configured, which this probe cannot see through)."""
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    u = urlparse(url)
    try:
        socket.create_connection((u.hostname, u.port or (443 if u.scheme == "https" else 80)), PROBE_TIMEOUT_S).close()
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


def _cached(name: str, revision: Optional[str]) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(name, "config.json", revision=revision), str)
    except Exception:  # an id the cache layout refuses
        return False


def locate(name: str, what: str = "model", revision: Optional[str] = None) -> dict[str, Any]:
    """Extra keyword arguments for from_pretrained(name): {} or, when the hub cannot be reached but the
    model is cached, {"local_files_only": True}. Raises ModelSourceError for a missing local path, and
    for a hub id that is not cached while HF_HUB_OFFLINE is set or the hub cannot be reached."""
    if os.path.isdir(os.path.expanduser(name)):
        return {}
    if looks_local(name):
        raise ModelSourceError(f"{what}={name!r} does not exist (no such directory); pass an existing model dir "
                               "or a hub id (org/name)")
    cached = _cached(name, revision)
    if offline():
        if cached:
            return {}
        raise ModelSourceError(f"{what}={name!r} is not a local dir and not in the local hub cache, and "
                               "HF_HUB_OFFLINE=1 blocks downloads; pass a local model dir, or unset HF_HUB_OFFLINE "
                               "on a machine with a network to download it once")
    why = unreachable(endpoint())
    if why is None:
        return {}
    if cached:
        log.warning("%s=%s: the hub (%s) cannot be reached (%s); loading the cached copy", what, name, endpoint(), why)
        return {"local_files_only": True}
    raise ModelSourceError(f"{what}={name!r} is not a local dir, and the hub at {endpoint()} cannot be reached "
                           f"({why}) to download it; connect to a network (or set HF_ENDPOINT to a reachable "
                           "mirror), or pass a local model dir")


def pretrained(load: Callable[..., Any], name: str, what: str = "model", **kw: Any) -> Any:
    """load(name, **kw) (a from_pretrained) after `locate`; a hub id that still fails to load (no such repo,
    gated, no token) becomes one ModelSourceError. A local dir's own errors (a broken file) pass through."""
    extra = locate(name, what, kw.get("revision"))
    if os.path.isdir(os.path.expanduser(name)):
        return load(name, **kw)
    try:
        return load(name, **kw, **extra)
    except Exception as e:  # OSError, HTTP errors, validation errors: all mean "this id did not load"
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ModelSourceError(
            f"{what}={name!r} could not be loaded from the hub at {endpoint()} ({type(e).__name__}: {first}); check "
            "the id, give a token for a gated or private model (HF_TOKEN or `hf auth login`), or pass a local "
            "model dir") from None
