"""vLLM general plugin: keep NIXL's progress thread from busy-spinning on CPU.

nixl 1.5.1's `nixl_agent.__init__` sets the agent config's `pthrDelay` to 0, and vLLM always
enables NIXL's progress thread, so the thread polls UCX with a zero timeout forever (~95 % of a
core per engine, idle or not; on 2 cores it starves both engines). vLLM loads every
`vllm.general_plugins` entry point in each of its processes before the KV connector is built;
setup.sh installs this module with such an entry point next to NIXL (on the servers'
PYTHONPATH only), and `register` makes every agent the bindings create keep `pthrDelay` at or
above TOKENONCE_NIXL_PTHR_DELAY_US (default 1000 us: idle engines at 3-4 % of a core, a
0.25 MB transfer ~0.3 ms). Nothing of vLLM or NIXL changes on disk.
"""

import importlib
import logging
import os

logger = logging.getLogger("vllm.tokenonce_nixl_progress_delay")
BACKENDS = ("nixl_cu13", "nixl_cu12", "nixl_rocm")


def floor_us():
    return max(0, int(os.environ.get("TOKENONCE_NIXL_PTHR_DELAY_US", "1000")))


def clamp(bindings, floor):
    """Replace `bindings.nixlAgent` with a subclass that raises the config's delay to `floor`."""
    original = bindings.nixlAgent
    if getattr(original, "tokenonce_pthr_floor", None) is not None:
        return False  # already done in this process (vLLM may call plugins more than once)

    class FlooredAgent(original):
        tokenonce_pthr_floor = floor

        def __init__(self, name, config, *rest):
            if config.pthrDelay < floor:
                config.pthrDelay = floor
            super().__init__(name, config, *rest)

    FlooredAgent.__name__ = original.__name__
    bindings.nixlAgent = FlooredAgent
    return True


def register():
    floor = floor_us()
    for backend in BACKENDS:
        try:
            bindings = importlib.import_module(f"{backend}._bindings")
        except ImportError:
            continue
        if clamp(bindings, floor):
            logger.info("NIXL progress thread delay floor %d us (%s)", floor, backend)
        return
    logger.warning("tokenonce NIXL delay plugin: no NIXL bindings found; nothing changed")
