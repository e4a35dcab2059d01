"""Loads attn_ext's compiled operators, and says clearly when the build does not fit.

The compiled library (attn_ext._C) registers the operators ``torch.ops.attn_ext.*``
when it is loaded. setup.py writes ``_build_info.py`` beside it with what the
library was built against, so a mismatch is found before the library is loaded.
"""

import importlib

import torch

REBUILD = "pip install --no-build-isolation --force-reinstall --no-deps ."


def parse_build_info(text):
    """'key=value;key=value' -> dict."""
    return dict(item.split("=", 1) for item in text.split(";") if "=" in item)


def built_for():
    """What the compiled library was built against, from _build_info.py (no loading)."""
    try:
        from ._build_info import BUILD_INFO
    except ImportError:
        return None
    return parse_build_info(BUILD_INFO)


def version():
    """attn_ext's version: pyproject.toml's, as setup.py recorded it in the build info."""
    return (built_for() or {}).get("version", "unknown")


def load_library():
    info = built_for()
    if info is None:
        raise ImportError(
            "attn_ext's compiled library has not been built: run `" + REBUILD + "` in the attn_ext source folder"
        )
    if info.get("torch") != torch.__version__:
        raise ImportError(
            f"attn_ext was built for torch {info.get('torch')} but torch {torch.__version__} is installed: "
            f"rebuild it with `{REBUILD}` in the attn_ext source folder"
        )
    try:
        importlib.import_module("attn_ext._C")
    except (ImportError, OSError) as e:
        raise ImportError(
            f"attn_ext's compiled library (built for torch {info.get('torch')}) failed to load: {e}; "
            f"rebuild it with `{REBUILD}`"
        ) from e


def library_info():
    """What the loaded library reports of itself (torch.ops.attn_ext.build_info)."""
    return parse_build_info(torch.ops.attn_ext.build_info())


load_library()
