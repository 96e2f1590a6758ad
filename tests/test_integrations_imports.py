"""integrations/ (the framework glue) imports refitd's client and engine adapters, never the daemon, and
each framework only when its own module is imported: refitd installs and imports without any framework.

Checked twice: every import statement in integrations/*.py (at any depth), and what a fresh interpreter
has loaded after importing the framework-free modules.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: the refitd modules the glue may import: the client library, the plan (declared tensors), the
#: runtime directory's default socket, errors, the engine adapters, and the glue itself
ALLOWED = (
    "sidecar.client",
    "sidecar.plan",
    "sidecar.config.runtime_dir",
    "sidecar.errors",
    "adapters",
    "integrations",
)
FIRST_PARTY = ("sidecar", "transport", "adapters", "integrations")
#: a framework (or an engine) each glue module may import, by module; integrations/__init__ none
FRAMEWORKS = {
    "verl": ("verl", "ray"),
    "verl_vllm": ("verl", "vllm"),
    "verl_sglang": ("verl", "ray", "sglang"),
}


def imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_the_glue_imports_only_the_client_the_adapters_and_its_own_framework():
    problems = []
    for path in sorted((ROOT / "integrations").glob("*.py")):
        allowed_frameworks = FRAMEWORKS.get(path.stem, ())
        for name in sorted(imported(path)):
            top = name.split(".")[0]
            if top in FIRST_PARTY:
                if not any(name == a or name.startswith(a + ".") for a in ALLOWED):
                    problems.append(f"{path.name}: imports {name}")
            elif top not in sys.stdlib_module_names and top not in ("torch", *allowed_frameworks):
                problems.append(f"{path.name}: imports {name} (a framework belongs in its own module)")
    assert not problems, problems


def test_importing_the_package_and_the_framework_free_modules_loads_no_daemon_and_no_framework():
    code = (
        "import json, sys\n"
        "import integrations\n"
        "bare = sorted(m for m in sys.modules if m.startswith(('sidecar', 'adapters', 'verl', 'nemo_rl', 'megatron')))\n"
        "import integrations.push, integrations.nemo_rl\n"
        "print(json.dumps({'bare': bare, 'loaded': sorted(sys.modules)}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["bare"] == [], seen["bare"]  # the package's __init__ imports nothing of refitd or a framework
    loaded = seen["loaded"]
    assert not [m for m in loaded if m.startswith("sidecar.daemon")], "the glue pulled in the daemon"
    assert not [m for m in loaded if m.split(".")[0] in ("verl", "nemo_rl", "megatron", "vllm", "sglang")]
