"""nvrar inside inference engines, without patching them: plugins that vLLM and SGLang load
through their own entry points (``pyproject.toml``: ``vllm.general_plugins``,
``vllm.platform_plugins``, ``sglang.srt.plugins``, each named ``nvrar``).

Every plugin is dormant unless its variable enables it (``NVRAR_VLLM``, ``NVRAR_SGLANG``), may be
loaded any number of times, and importing nvrar or this package imports no engine: the engine's
modules are imported only when the engine itself calls the plugin. See docs/engines.md.
"""

from __future__ import annotations

__all__: list = []
