"""Without torch installed, constructing the torch engine fails naming the install command.

Runs in a subprocess where ``import torch`` is made to fail, so it checks the message
whether or not torch is installed here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_missing_torch_names_the_extra(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from pathlib import Path\n"
        "from llmproxy.backend.engines.torch.engine import TorchEngine\n"
        "from llmproxy.backend.engines.torch.loader import TorchUnavailable\n"
        "from llmproxy.backend.settings import BackendSettings\n"
        "try:\n"
        "    TorchEngine(BackendSettings(engine='torch'), Path('m.gguf'))\n"
        "except TorchUnavailable as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert "pip install 'llmproxy[torch]'" in out.stdout, out.stderr
