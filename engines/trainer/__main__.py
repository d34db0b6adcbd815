"""Entry module of the trainer process: `python -m engines.trainer --config trainer.json` (RL) or
`--config sft.json` (warm-up); the config's `mode` field picks which."""

import argparse
import logging

from storage.fs import read_json


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engines.trainer", description=__doc__)
    parser.add_argument("--config", required=True, help="resolved trainer or sft config (JSON)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    data = read_json(args.config)
    if data.get("mode") == "sft":
        from config.process import SFTProcessConfig
        from engines.trainer.sft import run_sft

        run_sft(SFTProcessConfig.model_validate(data))
    else:
        from config.process import TrainerProcessConfig
        from engines.trainer.rl import RLTrainer

        RLTrainer(TrainerProcessConfig.model_validate(data)).run()


main()
