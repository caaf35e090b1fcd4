"""bench/startup.py's import profile: `-X importtime` lines read back into the imports that made
a start slow, each with what it brought in."""

from __future__ import annotations

from tests.support.scripts import load_bench_script

startup = load_bench_script("startup")

# As Python writes them: an import's line after those of the imports it made, two spaces deeper
# each level; a server's own log lines in between.
PROFILE = """\
import time: self [us] | cumulative | imported package
import time:    100000 |     100000 | site
2026-11-29 02:00:00 INFO kvfleet.engine: loading
import time:     50000 |     900000 |         torch._dynamo
import time:     10000 |     910000 |       torchvision.ops
import time:     20000 |    1000000 |     torchvision
import time:     30000 |      30000 |     PIL
import time:     40000 |    1100000 |   transformers.image_utils
import time:      5000 |       5000 |   transformers.video_utils
import time:     60000 |    1200000 | transformers.utils.type_validators
import time:    300000 |     500000 | transformers
"""


def test_the_import_tree_nests_each_import_under_the_one_that_made_it():
    site, validators, transformers = startup.import_tree(PROFILE.splitlines())
    assert (site.name, transformers.name) == ("site", "transformers")
    assert [c.name for c in validators.children] == [
        "transformers.image_utils",
        "transformers.video_utils",
    ]
    [torchvision, pil] = validators.children[0].children
    assert (torchvision.name, pil.name) == ("torchvision", "PIL")
    assert torchvision.cumulative_us == 1_000_000
    assert torchvision.children[0].children[0].name == "torch._dynamo"


def test_the_heaviest_imports_come_first_with_their_heaviest_children():
    lines = startup.heaviest_imports(PROFILE.splitlines(), count=2, children=1)
    assert lines == [
        "  1.20s transformers.utils.type_validators (transformers.image_utils 1.10s)",
        "  0.50s transformers",
    ]
