from engines.orchestrator.loop import main

main()
