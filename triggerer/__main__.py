from triggerer.cli import main

main()
