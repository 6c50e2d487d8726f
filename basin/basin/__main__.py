from basin.cli import main

main()
