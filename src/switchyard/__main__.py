from switchyard.cli.main import main

main()
