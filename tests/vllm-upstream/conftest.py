"""Not vLLM's: vLLM's own tests below run with sublet switched on in their process, as sublet's
plug-in does in every vLLM process: SUBLET_VLLM=1, then the plug-in (the version check, the
"sublet" backend registered, vLLM's allocator lookup routed to sublet's). tests/run-vllm runs
them; the test files themselves are vLLM's, unmodified (README.md)."""

import os

from sublet.compat import vllm_switch

os.environ[vllm_switch.ENV] = "1"
vllm_switch.plug_in()
assert vllm_switch.routed(), "sublet did not take vLLM's sleep allocator"
