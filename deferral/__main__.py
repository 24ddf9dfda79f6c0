from deferral.cli import main

main()
