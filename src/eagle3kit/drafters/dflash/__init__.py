"""DFlash, the block drafter kind: ``network`` (the drafter), ``objective`` (its loss and block
drafting), ``trainer``, ``folder`` (the layouts vLLM and speculators load), ``check``, ``evaluate``,
``faults`` (what ``diagnose`` simulates), and ``kind.KIND`` joining them for the stages."""
