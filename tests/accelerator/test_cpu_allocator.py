"""CPU ranks keep freed host memory for reuse: a step's second large buffer costs no page faults."""
import json
import os
import subprocess
import sys

import pytest

from ascendspeed.accelerator import cpu_allocator

pytestmark = pytest.mark.skipif(cpu_allocator._glibc() is None, reason="the C library is not glibc")

#: In a fresh process: import the adaptor, then fill a freed-and-reallocated 64 MiB tensor as a training step's
#: iterations do, and count the page faults of the later fills, the fewest of three: the process's fault counter
#: also counts what other threads and the kernel do meanwhile (one CI run counted a whole buffer's faults once
#: with the policy applied). The first fills grow the heap; depending on where the heap starts (address-space
#: randomisation) a small block can land at the start of the freed buffer and push the next one up by 128
#: bytes, for up to five fills here, before the heap holds room for both: eight warm-up fills.
PROBE = """
import json, resource, torch
import ascendspeed.megatron_adaptor  # noqa: F401
from ascendspeed import accelerator

def faults_of_a_step_buffer():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer = torch.empty(16 << 20, dtype=torch.float32)  # 64 MiB, above glibc's largest mmap threshold
    buffer.fill_(1.0)
    del buffer
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

for _ in range(8):
    faults_of_a_step_buffer()
faults = [faults_of_a_step_buffer() for _ in range(3)]
print(json.dumps({"device": accelerator.device_type(), "faults": min(faults), "each": faults}))
"""


def _step_buffer_faults(policy):
    environment = {name: value for name, value in os.environ.items() if not name.startswith("MALLOC_")}
    environment.update(ASCENDSPEED_DEVICE="cpu", **({cpu_allocator.ENVIRONMENT_VARIABLE: policy} if policy else {}))
    result = subprocess.run([sys.executable, "-c", PROBE], env=environment, capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["device"] == "cpu"
    return report["faults"], report["each"]


def test_freed_host_memory_is_reused_by_default_and_given_back_with_the_system_policy():
    pages = (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    kept, kept_each = _step_buffer_faults(None)
    system, system_each = _step_buffer_faults("system")
    assert kept < pages // 100, f"page faults {kept_each} for a reused 64 MiB buffer ({pages} pages)"
    assert system > pages // 2, f"glibc's defaults fault a fresh 64 MiB mapping in: {system_each} of {pages} pages"


def test_an_unknown_policy_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv(cpu_allocator.ENVIRONMENT_VARIABLE, "jemalloc")
    with pytest.raises(ValueError, match="ASCENDSPEED_CPU_ALLOCATOR='jemalloc': expected one of keep, system"):
        cpu_allocator.requested_policy()
