"""Entry module of the trainer process: `python -m engines.trainer --config trainer.json` (RL) or
`--config sft.json` (warm-up); the config's `mode` field picks which."""

from engines.entry import read_process_config


def main(argv: list[str] | None = None) -> None:
    data = read_process_config("engines.trainer", __doc__, argv)
    if data.get("mode") == "sft":
        from config.process import SFTProcessConfig
        from engines.trainer.sft import run_sft

        run_sft(SFTProcessConfig.model_validate(data))
    else:
        from config.process import TrainerProcessConfig
        from engines.trainer.rl import RLTrainer

        RLTrainer(TrainerProcessConfig.model_validate(data)).run()


main()
