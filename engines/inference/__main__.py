from engines.inference.server import main

main()
