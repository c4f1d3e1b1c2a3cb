"""``python -m engine.lm_eval ...``: lm-evaluation-harness's own CLI, with ``--model engine`` registered.

    python -m engine.lm_eval run --model engine --model_args pretrained=PATH dtype=float32 \\
        --tasks engine_mc --include_path fixtures/lm_eval_tasks
"""

from __future__ import annotations

from engine.lm_eval import register


def main() -> None:
    from lm_eval.__main__ import cli_evaluate

    register()
    cli_evaluate()


if __name__ == "__main__":
    main()
