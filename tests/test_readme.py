"""The README's first example runs as written and prints what its comments say."""

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_quick_example_runs(live):
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    assert scope["m"].get_comm_counts() == {"all_gather": 2}
    assert torch.equal(scope["d"].to_local(3), torch.tensor([[10., 11.], [14., 15.]]))
    assert torch.equal(scope["r"].to_torch(), torch.arange(16.).reshape(4, 4))
