from switchyard.cli import main

main()
