"""Import paths: code of the user's named "package.module:attribute" in a config (reward factories, environment
factories, env.advantage). One loader, so every such name fails alike: an ImportPathError whose `reason` names
the module or the attribute and the fix. Importing runs the module's code: a config that names one runs it
wherever the config is loaded. JAX-free."""

from __future__ import annotations

import importlib
from collections.abc import Callable


class ImportPathError(ValueError):
    """A name that does not resolve to a callable. `reason` is the message without the name, for callers that
    name the config key themselves."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"{name!r}: {reason}")
        self.name, self.reason = name, reason


def import_object(path: str, what: str = "factory") -> Callable:
    """The callable named by "package.module:attribute" (the attribute may be dotted: Class.method). Every failure
    is an ImportPathError naming the module and the attribute; `what` names what it should be."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ImportPathError(path, f"expected an import path 'package.module:{what}'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ImportPathError(path, f"no module named {e.name} (put the directory that holds it on "
                                        "PYTHONPATH, or install it)") from e
        raise ImportPathError(path, f"importing module {module_name} raised ModuleNotFoundError: {e}") from e
    except Exception as e:  # noqa: BLE001 - user code: report it, whatever it raised
        raise ImportPathError(path, f"importing module {module_name} raised {type(e).__name__}: {e}") from e
    found = module
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise ImportPathError(path, f"module {module_name} has no attribute {attribute!r}")
        found = getattr(found, part)
    if not callable(found):
        raise ImportPathError(path, f"{module_name}.{attribute} is a {type(found).__name__}, not a {what}")
    return found
