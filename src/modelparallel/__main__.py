from modelparallel.launch.cli import main

main()
