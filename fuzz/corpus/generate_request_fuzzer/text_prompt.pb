
In the beginning God created