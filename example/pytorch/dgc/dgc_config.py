"""The configuration of example/pytorch/dgc/train.py: one tree of settings that the config files
fill in, in the order given, later files overriding earlier ones (the style of DGC's reference
code, written afresh here).

A config file is Python that imports the shared tree and assigns to it:

    from dgc_config import Config, configs
    configs.train.num_epochs = 200
    configs.model = Config(name="resnet20", num_classes=10)

Loading ``configs/cifar/resnet20.py`` first runs every ``__init__.py`` of the folders above it
(``configs/__init__.py``, then ``configs/cifar/__init__.py``), each once per run, as importing
a Python package would. ``--configs.a.b VALUE`` then replaces one existing setting.

Values are plain data (numbers, strings, booleans, None, lists, nested Configs), so the
resolved tree prints as JSON; the training script turns names into models and codecs.
"""
import ast
import os
import runpy


class ConfigError(Exception):
    """A config file or an override that cannot be applied; the message says which and why."""


class Config(dict):
    """A dict whose keys are also attributes: ``c.train.lr`` is ``c["train"]["lr"]``."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"no setting {name!r} (have: {', '.join(sorted(self)) or 'none'})") from None

    def __setattr__(self, name, value):
        self[name] = value

    def __delattr__(self, name):
        del self[name]

    def to_plain(self):
        """The tree as nested dicts and lists (for JSON)."""
        return {k: v.to_plain() if isinstance(v, Config) else list(v) if isinstance(v, tuple) else v
                for k, v in self.items()}


configs = Config()


def reset():
    """Empties the shared tree (one process may load more than one set of files: tests)."""
    configs.clear()


def package_inits(path):
    """The ``__init__.py`` files of the packages holding ``path``, outermost first."""
    inits, folder = [], os.path.dirname(os.path.abspath(path))
    while os.path.isfile(os.path.join(folder, "__init__.py")):
        inits.append(os.path.join(folder, "__init__.py"))
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    return inits[::-1]


def find(path, search):
    """``path`` as given (relative to the working directory), else under each of ``search``."""
    for base in ["", *search]:
        candidate = os.path.join(base, path) if base else path
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
    where = ", ".join(["the working directory", *search])
    raise ConfigError(f"config file {path!r} not found (looked in {where})")


def load(paths, search=()):
    """Runs the config files ``paths`` in order (each after its packages' ``__init__.py``)."""
    done = set()
    for path in paths:
        full = find(path, search)
        if not full.endswith(".py"):
            raise ConfigError(f"config file {path!r}: not a .py file")
        for script in package_inits(full) + [full]:
            if script in done:
                continue
            done.add(script)
            try:
                runpy.run_path(script, run_name="__config__")
            except ConfigError:
                raise
            except Exception as e:  # a broken config file: name it and the error, no traceback
                raise ConfigError(f"config file {script}: {type(e).__name__}: {e}") from None
    return configs


def parse_value(text):
    """A command-line value: a Python literal (500, 0.1, True, None, [0.25, 0.063], 'x'), else
    the text itself (a path, a name)."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        lowered = text.lower()
        if lowered in ("true", "false"):
            return lowered == "true"
        if lowered in ("none", "null"):
            return None
        return text


def override(key, text):
    """Sets the existing setting ``key`` (dotted, e.g. train.num_epochs) from ``text``."""
    parts = key.split(".")
    node = configs
    for i, part in enumerate(parts[:-1]):
        child = node.get(part) if isinstance(node, Config) else None
        if not isinstance(child, Config):
            raise ConfigError(f"--configs.{key}: {'.'.join(parts[:i + 1])} is not a group of settings")
        node = child
    last = parts[-1]
    if last not in node:
        have = ", ".join(sorted(node)) or "none"
        raise ConfigError(f"--configs.{key}: no such setting (its group has: {have})")
    old, value = node[last], parse_value(text)
    if isinstance(old, Config):
        raise ConfigError(f"--configs.{key} is a group of settings; set one of: {', '.join(sorted(old))}")
    if isinstance(old, bool) and not isinstance(value, bool):
        raise ConfigError(f"--configs.{key}: want True or False, got {text!r}")
    if isinstance(old, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(old, (int, float)) and not isinstance(old, bool) and not isinstance(value, (int, float)) \
            and value is not None:
        raise ConfigError(f"--configs.{key}: want a number, got {text!r}")
    node[last] = value
    return value


def run_name(paths):
    """The run's name from its config files, as DGC names its run folders: each path without
    ``configs/`` and ``.py``, files in the same folder grouped: configs/cifar/resnet20.py
    configs/dgc/wm5.py configs/dgc/fp16.py -> [cifar.resnet20+dgc.[wm5+fp16]]."""
    tree = {}
    for path in paths:
        node = tree
        rel = path.replace(os.sep, "/")
        rel = rel[rel.index("configs/") + len("configs/"):] if "configs/" in rel else rel
        for part in rel[:-3].split("/") if rel.endswith(".py") else rel.split("/"):
            node = node.setdefault(part, {})

    def text(node):
        parts = [k + ("." + text(v) if v else "") for k, v in node.items()]
        return parts[0] if len(parts) == 1 else "[" + "+".join(parts) + "]"
    return text(tree)
