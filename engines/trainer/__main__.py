"""Entry module of the trainer process: `python -m engines.trainer --config trainer.json` (RL) or
`--config sft.json` (the warm-up, or a `rollflow sft` run); the config's `mode` field picks which. A dataset
the SFT trainer refuses exits with EXIT_REFUSED, which the flow does not restart."""

from engines.entry import exit_done, read_process_config
from engines.heartbeat import heartbeat


def main(argv: list[str] | None = None) -> None:
    data = read_process_config("engines.trainer", __doc__, argv)
    heartbeat().start_thread()  # progress for the flow's stall watch (engines/heartbeat.py)
    if data.get("mode") == "sft":
        from config.process import EXIT_REFUSED, SFTProcessConfig
        from engines.trainer.sft import run_sft
        from engines.trainer.sft_files import DataError

        try:
            run_sft(SFTProcessConfig.model_validate(data))
        except DataError as exc:
            print(f"refused: {exc}", flush=True)
            raise SystemExit(EXIT_REFUSED) from None
    else:
        from config.process import TrainerProcessConfig
        from engines.trainer.rl import RLTrainer

        RLTrainer(TrainerProcessConfig.model_validate(data)).run()
    exit_done()


main()
