from backends.cli import main

main()
