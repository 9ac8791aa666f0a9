from sidindex.cli import main

main()
