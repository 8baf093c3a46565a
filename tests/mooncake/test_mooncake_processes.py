"""Two engines in two processes share one master: A computes and stores a prefix and exits; B, which never saw it,
loads it from the store byte-exactly and its outputs equal a run that computed everything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

pytest.importorskip("mooncake.store")

ENGINE = """
import json, sys
from kvfsm.executor import SimDevice
from kvfsm.testing.harness import Harness
from kvfsm.engine.oracle import expected_tokens

master, tenant = sys.argv[1], sys.argv[2]
prompt = tuple(range(3, 3 + 24))
h = Harness(SimDevice(), num_gpu_blocks=16, cpu_blocks=16, mooncake_master=master,
            mooncake_options={"tenant": tenant})
h.add_request(prompt, max_new_tokens=4)
for _ in range(500):  # to idle, tiers included: A's write-backs must land before it exits
    if not (h.engine.has_work or h.connector.moving_between_tiers):
        break
    h.engine.step()
    h.settle()
stats = h.connector.scheduler.tiers.stats
tier = h.mooncake
store = tier.client.raw()
exact = all(store.get(tier.store_key(e.key))[:tier.block_bytes] == h.oracle.cpu_block_bytes(e.key).numpy().tobytes()
            for e in tier.entries)
report = {"violations": h.final_violations(), "outputs": list(h.engine.outputs().values()),
          "expected": list(expected_tokens(prompt, 4, h.shape)),
          "loaded_from_store": stats.tokens_loaded_from["mooncake"],
          "written_back": stats.blocks_written_back["mooncake"], "store_bytes_exact": exact}
h.close()
print("REPORT " + json.dumps(report))
"""


def run_engine(master: str, tenant: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", ENGINE, master, tenant], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("REPORT "))
    return json.loads(line.removeprefix("REPORT "))


def test_engine_b_reloads_what_engine_a_stored_in_another_process(mooncake) -> None:
    tenant = uuid.uuid4().hex
    a = run_engine(str(mooncake.address), tenant)
    assert a["violations"] == [] and a["written_back"] > 0 and a["loaded_from_store"] == 0, a
    b = run_engine(str(mooncake.address), tenant)
    assert b["violations"] == []
    assert b["loaded_from_store"] > 0, "engine B recomputed the prefix instead of loading it"
    assert b["store_bytes_exact"]
    assert b["outputs"] == [b["expected"]] == a["outputs"]
